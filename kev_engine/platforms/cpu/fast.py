"""The fast CPU backend (`batch_invariant=False` with Kev's kernels): the torch backend's layout
and prefill, Kev's C++ kernels for decode and KV writes.

Decode rows: ONE call per layer of `paged_decode` (csrc/paged_decode.cpp) over every row's block
table, reading only each row's own positions — so blocks just handed out need no clearing.
New keys/values: `paged_write`, a row copy each instead of two index_put calls a layer.
Equal to the torch backend up to fp32 rounding (the fast build, -ffast-math).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ...model.pack import PackedBatch, Segment
from ..torch_ops import DecodeLayout, TorchBackend, kernel_decode_layout


class FastBackend(TorchBackend):
    name: ClassVar[str] = "fast"
    reads_whole_blocks: ClassVar[bool] = False

    def __init__(self, kernels: Any) -> None:
        super().__init__()
        self.kernels = kernels  # `kernels.Kernels`

    def plan(self, segments: Sequence[Segment], cu_seqlens: list[int], device: torch.device | str) -> Any:
        return kernel_decode_layout(segments, cu_seqlens, self.pool.block_size, device)

    def write(self, layer: int, batch: PackedBatch, key: torch.Tensor, value: torch.Tensor) -> None:
        self.pool.check_new(key)
        self.kernels.paged_write(self.pool.keys[layer], self.pool.values[layer], key, value,
                                 batch.slot_blocks, batch.slot_offsets)

    def decode_rows(self, rows: torch.Tensor, decode: DecodeLayout, layer: int, scaling: float | None) -> torch.Tensor:
        assert decode.tables is not None and decode.lengths is not None
        scale = scaling if scaling is not None else rows.shape[-1] ** -0.5
        return self.kernels.paged_decode(rows, self.pool.keys[layer], self.pool.values[layer], decode.tables,
                                         decode.lengths, scale)
