"""The CUDA platform: the varlen attention, decode CUDA graphs, batch invariance by Triton.

Batch-invariant where the attention keeps one order per query (Kev's Triton kernel; torch's
`varlen_attn` unsplit, `num_splits=1` in its paged form, its contiguous form never splitting, see
`gathered`) and Triton loads: every `nn.Linear`, the output head and LoRA deltas, and the RMSNorms
by fixed-order Triton kernels (`invariant`). Decode graphs need a paged form (fixed-size tables:
Kev's Triton kernel or the paged varlen_attn). Without any (`choice.choose` said why), attention
runs on torch's SDPA per segment, with neither graphs nor invariance.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ...model.pack import PackedBatch
from ...models.ops import Ops
from .. import inplace
from ..base import AttentionBackend, Platform
from ..torch_ops import TorchBackend
from . import invariant
from .graphs import DecodeGraphs
from .ops import InvariantOps, fixed_order_delta
from .varlen import VarlenBackend

DEFAULT_KV_FRACTION = 0.5  # of the device memory still free after the model loaded


class CudaPlatform(Platform):
    name = "cuda"
    default_pass_ms = 100.0

    def __init__(self, device: torch.device, paged: VarlenBackend | None, batch_invariant: bool, graphs: bool) -> None:
        attention: AttentionBackend = TorchBackend()
        if paged is not None:
            paged.num_splits = 1 if batch_invariant else None  # one key order per query: what invariance needs
            attention = paged
        super().__init__(device, attention, batch_invariant)
        self.paged = paged
        self.graphs = graphs

    def install(self, model: nn.Module) -> list[str]:
        if self.batch_invariant:
            linear = invariant.install(model)  # one reduction order per output, by Triton
            self.lora_products = functools.partial(fixed_order_delta, linear)
            return []
        inplace.install(model)
        return []

    def ops(self) -> Ops:
        if not self.batch_invariant:
            return Ops()
        kernels, why = invariant.triton_or_why()
        if why is not None:
            raise RuntimeError(why)
        from . import triton_elementwise  # Triton imports: `kernels` did

        return InvariantOps(kernels, triton_elementwise)

    def decode_graphs(self, forward: Callable[[PackedBatch], torch.Tensor], max_rows: int,
                      max_context: int) -> DecodeGraphs | None:
        if not self.graphs or self.paged is None or self.paged.form != "paged":
            return None  # a graph replays fixed-size tables: the gathered form's key count moves every pass
        pool = self.paged.pool
        trash = pool.reserve_last_block()
        pool.zero([trash])
        return DecodeGraphs(forward, pool, max_rows, max_context, trash, capture=self.device.type == "cuda")

    def default_kv_cache_bytes(self) -> int:
        if self.device.type != "cuda":  # the paged path tested on CPU tensors (tests/test_cuda_backend.py)
            return super().default_kv_cache_bytes()
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * DEFAULT_KV_FRACTION)

