"""The CUDA attention: every segment of a pass, prefill and decode, in ONE paged kernel call per layer.

Where this sits: the attention backend (`platforms.base`) of an `Engine` on a GPU, chosen once when
it starts (`choose`). The pool is [num_blocks, block_size, kv_heads, head_dim]; the pack's
`PagedTables` (its `plan`) say which blocks each segment reads (`block_table`) and how many of
their tokens (`seqused_k`). No mask is built: the
kernel's causal window (-1, 0) is bottom-right aligned, as a chunk continuing its own cached
prefix needs, and a decode row (one query) sees its whole context.

Kernels, in the order "auto" tries them:
  "varlen"      torch's own `torch.nn.attention.varlen.varlen_attn` in its paged form
                (`block_table`, `seqused_k`, `num_splits`, `enable_gqa`: torch 2.13 has them;
                torch 2.11's has none). Nothing to build or install.
  "flash-attn"  the optional `flash-attn` package's `flash_attn_varlen_func(block_table=...)`.
Neither usable: "auto" says why (a warning on the "kev" logger) and attention runs on torch's
SDPA per segment with the CPU pool layout; naming a kernel that cannot run is an error.

Batch invariance: `num_splits=1` keeps each query's keys in one thread block, walked in one
order, whatever else is in the pass (split-KV would choose its split from the batch). Both
kernels need a block size that is a multiple of 256 (flash attention's paged KV).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...model.kv_pool import Shape
from ...model.pack import PackedBatch, Segment, padded_block_table
from ..base import AttentionBackend

log = logging.getLogger("kev")

MODES = ("auto", "varlen", "flash-attn", "torch")
PAGED_PARAMETERS = ("block_table", "seqused_k", "num_splits", "enable_gqa", "window_size")
CAUSAL = (-1, 0)  # varlen_attn's window for causal attention (bottom-right aligned)
PAGE_MULTIPLE = 256  # flash attention's paged KV: "block size must be divisible by 256"
HALF = (torch.float16, torch.bfloat16)


def varlen_function() -> tuple[Callable[..., Any] | None, str | None]:
    """torch's `varlen_attn` if this torch has its paged form, else (None, why not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, (f"torch {torch.__version__} has no torch.nn.attention.varlen "
                      "(its paged varlen_attn is in torch 2.13)")
    parameters = inspect.signature(varlen_attn).parameters
    missing = [name for name in PAGED_PARAMETERS if name not in parameters]
    if missing:
        return None, (f"torch {torch.__version__}'s varlen_attn has no {', '.join(missing)} "
                      "(its paged form is in torch 2.13)")
    return varlen_attn, None


def flash_attn_function() -> tuple[Callable[..., Any] | None, str | None]:
    """The optional flash-attn package's paged varlen function, else (None, why not)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 - a broken build fails to import in many ways
        return None, f"the flash-attn package cannot be imported ({type(exc).__name__}: {exc})"
    return flash_attn_varlen_func, None


def why_not_device(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why flash attention cannot run for a model on `device` in `dtype`, or None."""
    if device.type != "cuda":
        return f"the model is on {device}; the paged kernels run on CUDA only"
    if dtype not in HALF:
        return f"the model is in {dtype}; flash attention computes float16 and bfloat16 (load with dtype='auto')"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; flash attention needs sm_80 or newer"
    return None


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


class CudaBackend(AttentionBackend):
    """One paged kernel call per layer over the whole pack: query [H, T, D] → [T, H, D].

    Pool layout [num_blocks, block_size, kv_heads, head_dim], keys and values alike. The kernel
    reads whole pages and masks the slots past `seqused_k`: blocks just handed out are cleared
    (0 × NaN from stale memory would be NaN)."""

    name: str  # type: ignore[misc]  # "varlen" or "flash-attn", per instance
    default_block_size: ClassVar[int] = PAGE_MULTIPLE

    def __init__(self, name: str, function: Callable[..., Any], page_multiple: int = PAGE_MULTIPLE,
                 num_splits: int | None = None) -> None:
        super().__init__()
        self.name = name
        self.function = function
        self.block_multiple = page_multiple
        self.num_splits = num_splits  # 1: the keys are never split (batch-invariant); None: the kernel decides

    def block_rule(self) -> str:
        return f"with cuda_attention={self.name!r}"

    def layout(self, num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> tuple[Shape, Shape]:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        return shape, shape

    def plan(self, segments: Sequence[Segment], cu_seqlens: list[int], device: torch.device | str) -> PagedTables:
        lengths = [seg.end for seg in segments]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return PagedTables(
            cu_seqlens_k=torch.tensor(cu, dtype=torch.int32, device=device),
            max_seqlen_k=max(lengths),
            block_table=padded_block_table(segments, lengths, self.pool.block_size, device),
            seqused_k=torch.tensor(lengths, dtype=torch.int32, device=device),
        )

    def write(self, layer: int, batch: PackedBatch, key: torch.Tensor, value: torch.Tensor) -> None:
        self.pool.check_new(key)
        self.pool.keys[layer][batch.slot_blocks, batch.slot_offsets] = key.transpose(0, 1)  # [T, kvH, D]
        self.pool.values[layer][batch.slot_blocks, batch.slot_offsets] = value.transpose(0, 1)

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


def resolve_mode(mode: str | None) -> str:
    mode = "auto" if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"cuda_attention={mode!r} is not allowed; use one of {list(MODES)}")
    return mode


def choose(mode: str | None, device: torch.device, dtype: torch.dtype) -> CudaBackend | None:
    """The paged kernel for an engine on `device`, or None for torch's SDPA path (CPU engines,
    "torch", or an "auto" engine where no paged kernel can run — with a warning saying why)."""
    mode = resolve_mode(mode)
    if mode == "torch":
        return None
    if device.type != "cuda":
        if mode != "auto":
            raise ValueError(f"cuda_attention={mode!r} names a CUDA kernel; this engine runs on {device}")
        return None
    reasons = []
    for name, find in (("varlen", varlen_function), ("flash-attn", flash_attn_function)):
        if mode not in ("auto", name):
            continue
        function, why = find()
        why = why or why_not_device(device, dtype)
        if why is None:
            assert function is not None
            return CudaBackend(name, function)
        if mode == name:
            raise ValueError(f"cuda_attention={name!r} cannot be honoured: {why}")
        reasons.append(f"{name}: {why}")
    log.warning("Kev: no paged CUDA attention (%s); attention runs on torch's SDPA per segment, without CUDA "
                "graphs and not batch-invariant", "; ".join(reasons))
    return None

