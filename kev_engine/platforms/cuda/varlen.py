"""The paged CUDA attention: every segment of a pass, prefill and decode, in ONE kernel call per layer.

Where this sits: the attention backend (`platforms.base`) of an `Engine` on a GPU whose torch has
the paged `varlen_attn` (torch 2.12 and later), or with the flash-attn package; `choice.choose`
picks it when the engine starts. The pool is [num_blocks, block_size, kv_heads, head_dim]; the
pack's `PagedTables` (its `plan`) say which blocks each segment reads (`block_table`) and how many
of their tokens (`seqused_k`). No mask is built: the kernel's causal window (-1, 0) is
bottom-right aligned, as a chunk continuing its own cached prefix needs, and a decode row (one
query) sees its whole context. torch 2.10 and 2.11 read contiguous keys only: `gathered` is their
backend.

Batch invariance: `num_splits=1` keeps each query's keys in one thread block, walked in one
order, whatever else is in the pass (split-KV would choose its split from the batch). Both paged
kernels need a block size that is a multiple of 256 (flash attention's paged KV).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...model.kv_pool import Shape
from ...model.pack import PackedBatch, Segment, padded_block_table
from ..base import AttentionBackend

CAUSAL = (-1, 0)  # varlen_attn's window for causal attention (bottom-right aligned)
PAGE_MULTIPLE = 256  # flash attention's paged KV: "block size must be divisible by 256"


@dataclass
class PagedTables:
    """What a paged varlen kernel reads besides the pool.

    Segment i's keys are its first `seqused_k[i]` positions, read through `block_table[i]`; its
    new tokens are the last ones of them, so the causal mask is bottom-right aligned. A CUDA graph
    fills static tensors of the same shape (`cuda.graphs`), with `max_seqlen_k` the
    longest context any row can reach: the kernel only uses it as an upper bound.
    """

    cu_seqlens_k: torch.Tensor  # [S+1] int32: cumulative seqused_k
    max_seqlen_k: int  # longest seqused_k this pass (or an upper bound of it)
    block_table: torch.Tensor  # [S, max_blocks] int32, zero-padded
    seqused_k: torch.Tensor  # [S] int32: tokens each segment attends to, its new ones included


def cumulative(lengths: list[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]: cu_seqlens of these lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


class VarlenBackend(AttentionBackend):
    """What both forms of the varlen kernel share: the pool layout [num_blocks, block_size,
    kv_heads, head_dim], keys and values alike, and each new key/value written to its slot."""

    name: str  # type: ignore[misc]  # "varlen", "triton" or "flash-attn", per instance
    form: ClassVar[str]  # "paged": read through block tables; "gathered": copied out per layer

    def __init__(self, name: str, function: Callable[..., Any], page_multiple: int,
                 num_splits: int | None = None) -> None:
        super().__init__()
        self.name = name
        self.function = function
        self.block_multiple = page_multiple
        self.num_splits = num_splits  # 1: the keys are never split (batch-invariant); None: the kernel decides

    def block_rule(self) -> str:
        return f"with cuda_attention={self.name!r} ({self.form})"

    def layout(self, num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> tuple[Shape, Shape]:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        return shape, shape

    def write(self, layer: int, batch: PackedBatch, key: torch.Tensor, value: torch.Tensor) -> None:
        self.pool.check_new(key)
        self.pool.keys[layer][batch.slot_blocks, batch.slot_offsets] = key.transpose(0, 1)  # [T, kvH, D]
        self.pool.values[layer][batch.slot_blocks, batch.slot_offsets] = value.transpose(0, 1)


class CudaBackend(VarlenBackend):
    """One paged kernel call per layer over the whole pack: query [H, T, D] → [T, H, D].

    The kernel reads whole pages and masks the slots past `seqused_k`: blocks just handed out are
    cleared (0 × NaN from stale memory would be NaN)."""

    form: ClassVar[str] = "paged"
    default_block_size: ClassVar[int] = PAGE_MULTIPLE

    def __init__(self, name: str, function: Callable[..., Any], page_multiple: int = PAGE_MULTIPLE,
                 num_splits: int | None = None) -> None:
        super().__init__(name, function, page_multiple, num_splits)

    def plan(self, segments: Sequence[Segment], cu_seqlens: list[int], device: torch.device | str) -> PagedTables:
        lengths = [seg.end for seg in segments]
        return PagedTables(
            cu_seqlens_k=torch.tensor(cumulative(lengths), dtype=torch.int32, device=device),
            max_seqlen_k=max(lengths),
            block_table=padded_block_table(segments, lengths, self.pool.block_size, device),
            seqused_k=torch.tensor(lengths, dtype=torch.int32, device=device),
        )

    def attend(self, layer: int, batch: PackedBatch, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None) -> torch.Tensor:
        tables: PagedTables = batch.attention
        assert isinstance(tables, PagedTables), "a pack on a CUDA pool carries its PagedTables"
        q = query.transpose(0, 1)  # [T, H, D]: a view of the projection's own layout
        keys, values = self.pool.keys[layer], self.pool.values[layer]  # [num_blocks, block_size, kvH, D]
        if self.name == "flash-attn":  # never the batch-invariant path (`invariant` asks for varlen)
            return self.function(q, keys, values, batch.cu_seqlens, tables.cu_seqlens_k, batch.max_seqlen,
                                 tables.max_seqlen_k, softmax_scale=scaling, causal=True,
                                 block_table=tables.block_table)
        # max_q is an upper bound, here never 1: flash attention's varlen forward turns causal off
        # when it is 1 (flash_api.cpp), running a decode-only pass through another kernel instance
        # than a decode row beside a prefill chunk (a precaution for invariance)
        max_q = max(batch.max_seqlen, 2)
        return self.function(
            q, keys, values, batch.cu_seqlens, tables.cu_seqlens_k, max_q, tables.max_seqlen_k,
            scale=scaling, window_size=CAUSAL, enable_gqa=q.shape[1] != keys.shape[2],
            seqused_k=tables.seqused_k, block_table=tables.block_table, num_splits=self.num_splits,
        )
