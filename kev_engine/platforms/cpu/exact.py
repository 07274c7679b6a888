"""The batch-invariant CPU backend: every row of a pass, prefill and decode alike, in ONE kernel call per layer.

`paged_attention` (csrc/attention.cpp, the exact build) walks each row's own positions in one
fixed order, so a row's result is the same shared, cached, chunked or alone (`invariance`).
Pool layout: each block's keys transposed, [num_blocks, kv_heads, head_dim, block_size], so one
head dimension of a block's positions is one vector load; values [num_blocks, kv_heads,
block_size, head_dim]. Block sizes are multiples of 16 (the kernel's position tile). The kernel
reads only each row's own positions: blocks just handed out need no clearing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...model.kv_pool import Shape
from ...model.pack import PackedBatch, Segment, padded_block_table
from ..base import AttentionBackend


@dataclass
class ExactTables:
    """The kernel's arguments beside the pool: every segment's blocks and how much of it is cached."""

    block_tables: torch.Tensor  # [S, max_blocks] int32, zero-padded
    past_lens: torch.Tensor  # [S] int32


class ExactBackend(AttentionBackend):
    name: ClassVar[str] = "exact"
    block_multiple = 16
    reads_whole_blocks: ClassVar[bool] = False

    def __init__(self, kernels: Any) -> None:
        super().__init__()
        self.kernels = kernels  # `kernels.Kernels`

    def block_rule(self) -> str:
        return "for the batch-invariant attention"

    def layout(self, num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> tuple[Shape, Shape]:
        return (num_blocks, kv_heads, head_dim, block_size), (num_blocks, kv_heads, block_size, head_dim)

    def plan(self, segments: Sequence[Segment], cu_seqlens: list[int], device: torch.device | str) -> ExactTables:
        lengths = [seg.end for seg in segments]
        past = torch.tensor([seg.past_len for seg in segments], dtype=torch.int32, device=device)
        return ExactTables(padded_block_table(segments, lengths, self.pool.block_size, device), past)

    def write(self, layer: int, batch: PackedBatch, key: torch.Tensor, value: torch.Tensor) -> None:
        self.pool.check_new(key)
        self.kernels.paged_write_transposed(self.pool.keys[layer], self.pool.values[layer], key, value,
                                            batch.slot_blocks, batch.slot_offsets)

    def attend(self, layer: int, batch: PackedBatch, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None) -> torch.Tensor:
        tables: ExactTables = batch.attention
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return self.kernels.paged_attention(query.transpose(0, 1).contiguous(), self.pool.keys[layer],
                                            self.pool.values[layer], tables.block_tables, batch.cu_seqlens,
                                            tables.past_lens, scale)
