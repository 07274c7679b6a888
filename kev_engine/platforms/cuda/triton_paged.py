"""The CUDA attention of Kev's own Triton kernel: the pool read in place, on every torch with Triton.

Where this sits: `choice.choose` picks it (`cuda_attention="triton"`, or "auto" where torch's
`varlen_attn` has no paged form: torch 2.10 and 2.11). The pool is the varlen layout,
[num_blocks, block_size, kv_heads, head_dim]; the pack's `PagedTables` are the paged varlen
backend's, so decode passes replay as CUDA graphs the same way (`graphs`). Against torch 2.11's
gathered form: no copy of each segment's keys per layer, and fixed-size tables a graph can replay.

Blocks may be any size (the kernel walks keys by position, not by page), and only the positions
each segment has written are read, so blocks just handed out need no clearing. Prefill chunks and
decode rows go through the same kernel, so a token's attention has one order whether it was
computed in a prompt's chunk, as a decode row, alone or packed (`triton_attention`).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ...model.pack import PackedBatch
from . import triton_attention
from .varlen import CudaBackend, PagedTables


class TritonBackend(CudaBackend):
    """One Triton kernel call per layer over the whole pack: query [H, T, D] → [T, H, D]."""

    default_block_size: ClassVar[int] = 32  # any size works; small blocks share prefixes finely
    reads_whole_blocks: ClassVar[bool] = False  # only written positions are read

    def __init__(self, shape_dependent: bool = False) -> None:
        """`shape_dependent`: the control, key blocks sized by the pass (tests; never an engine's own)."""
        super().__init__("triton", triton_attention.paged_attention, page_multiple=1, num_splits=1)
        self.shape_dependent = shape_dependent

    def block_rule(self) -> str:
        return "with cuda_attention='triton'"

    def attend(self, layer: int, batch: PackedBatch, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None) -> torch.Tensor:
        tables: PagedTables = batch.attention
        assert isinstance(tables, PagedTables), "a pack on a CUDA pool carries its PagedTables"
        return self.function(query.transpose(0, 1), self.pool.keys[layer], self.pool.values[layer], batch.cu_seqlens,
                             tables.seqused_k, tables.block_table, batch.max_seqlen, scaling,
                             shape_dependent=self.shape_dependent)
