"""The CUDA attention where torch's `varlen_attn` reads contiguous keys only (torch 2.10 and 2.11).

Where this sits: `choice.choose` picks it when the installed `varlen_attn` has no paged form
(no `block_table`, `seqused_k`, `num_splits`): it then takes (q, k, v, cu_seq_q, cu_seq_k, max_q,
max_k) with every segment's keys back to back, causal asked by `window_size=(-1, 0)` (2.11) or
`is_causal=True` (2.10), bottom-right aligned as in the paged form. The pool keeps the paged layout
[num_blocks, block_size, kv_heads, head_dim]; the pack's `GatheredTables` list the pool slot of
every key each segment attends to, its cached prefix and its new tokens, and each layer copies
them out (one `index_select` for keys, one for values) before ONE kernel call for the whole pass.

What this costs against the paged form: each layer reads every segment's context twice (the
gather, then the kernel), and decode passes run eagerly (a graph would need one fixed gather
size). Blocks are any size (no 256 multiple), and only the slots listed are read, so stale
memory in a block just handed out is never touched.

Batch invariance: flash attention's varlen forward on contiguous keys sets up no split of the
keys (it does only for paged keys, or for one-query GQA calls it regroups): each query's keys are
walked by one thread block in one order, whatever else is in the pass, as long as `max_q` is at
least 2 (see `attend`). `make gpu-check` checks packed == alone bit for bit on this path too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...core.blocks import blocks_for
from ...model.pack import PackedBatch, Segment
from .varlen import CAUSAL, VarlenBackend, cumulative


@dataclass
class GatheredTables:
    """What the contiguous varlen kernel reads besides the gathered keys.

    Segment i's keys are `slots[cu_seqlens_k[i]:cu_seqlens_k[i+1]]` of the pool (block × block_size
    + offset), in position order; its new tokens are the last ones of them.
    """

    cu_seqlens_k: torch.Tensor  # [S+1] int32: cumulative tokens each segment attends to
    max_seqlen_k: int
    slots: torch.Tensor  # [total keys] long: the pool slot of each, segment after segment


def gather_slots(segments: Sequence[Segment], lengths: list[int], block_size: int) -> torch.Tensor:
    """[sum(lengths)] long: the pool slot of each segment's first `lengths[i]` tokens, in order."""
    offsets = torch.arange(block_size)
    parts = []
    for seg, n in zip(segments, lengths):
        blocks = torch.tensor(seg.block_ids[: blocks_for(n, block_size)], dtype=torch.long)
        parts.append((blocks[:, None] * block_size + offsets).flatten()[:n])
    return torch.cat(parts)


class GatheredBackend(VarlenBackend):
    """One contiguous varlen call per layer over the whole pack, after gathering its keys/values."""

    form: ClassVar[str] = "gathered"
    default_block_size: ClassVar[int] = 32  # any size works; small blocks share prefixes finely
    reads_whole_blocks: ClassVar[bool] = False  # only the listed slots are read

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__("varlen", function, page_multiple=1)
        parameters = inspect.signature(function).parameters
        self.causal: dict[str, Any] = {"window_size": CAUSAL} if "window_size" in parameters else {"is_causal": True}
        self.takes_enable_gqa = "enable_gqa" in parameters  # else grouped heads are the kernel's own (flash's are)

    def plan(self, segments: Sequence[Segment], cu_seqlens: list[int],
             device: torch.device | str) -> GatheredTables:
        lengths = [seg.end for seg in segments]
        return GatheredTables(
            cu_seqlens_k=torch.tensor(cumulative(lengths), dtype=torch.int32, device=device),
            max_seqlen_k=max(lengths),
            slots=gather_slots(segments, lengths, self.pool.block_size).to(device),
        )

    def attend(self, layer: int, batch: PackedBatch, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None) -> torch.Tensor:
        tables: GatheredTables = batch.attention
        assert isinstance(tables, GatheredTables), "a pack on the gathered CUDA path carries its GatheredTables"
        q = query.transpose(0, 1)  # [T, H, D]
        pool_keys, pool_values = self.pool.keys[layer], self.pool.values[layer]  # [num_blocks, block_size, kvH, D]
        keys = pool_keys.view(-1, *pool_keys.shape[2:]).index_select(0, tables.slots)  # [total keys, kvH, D]
        values = pool_values.view(-1, *pool_values.shape[2:]).index_select(0, tables.slots)
        extra = {"enable_gqa": q.shape[1] != keys.shape[1]} if self.takes_enable_gqa else {}
        # max_q is an upper bound, here never 1: with max_q 1 flash attention's varlen forward turns
        # causal off and, for grouped heads, regroups the queries and lets a heuristic split the keys
        # by the batch's size: a decode row would then not compute alike alone and among others
        max_q = max(batch.max_seqlen, 2)
        return self.function(q, keys, values, batch.cu_seqlens, tables.cu_seqlens_k, max_q, tables.max_seqlen_k,
                             scale=scaling, **self.causal, **extra)
