"""Kev's model's ops on CUDA: fixed-order Triton products and norms where the engine is batch-invariant.

Where this sits: `CudaPlatform.ops()` hands these to Kev's model (`models.llama.DecoderModel.use`).
Batch-invariant (`invariant`): every product (the output head and LoRA deltas too) by
`triton_kernels.linear`, tiles set by the weight's shape and one K order for every row count;
every RMSNorm (Qwen3's per-head norms too) by `triton_kernels.rms_norm`, one program per row, the
residual add before a layer's norm in the same launch (`add_rms_norm`); attention is the paged
backend's, unsplit, or Kev's Triton attention. The rotary of queries and keys and the MLP's
silu·mul are one launch each (`triton_elementwise`): elementwise, one formula per element whatever
the shape, and a decode graph replays fewer launches. Otherwise torch's ops (`models.ops.Ops`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...adapters.lora import LoraWeights
from ...models.layout import Linear
from ...models.ops import Ops


class InvariantOps(Ops):
    name = "cuda-invariant"

    def __init__(self, kernels: Any, elementwise: Any) -> None:
        self.kernels = kernels  # `triton_kernels`
        self.elementwise = elementwise  # `triton_elementwise`

    def linear(self, x: torch.Tensor, linear: Linear, prompt: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.linear(x, linear.weight, linear.bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.add_rms_norm(x, delta, weight, eps)

    def rotary_qk(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.elementwise.rotary_qk(query, key, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor, width: int) -> torch.Tensor:
        return self.elementwise.silu_mul(gate_up, width)

    def lora_products(self, weights: LoraWeights, x: torch.Tensor) -> torch.Tensor:
        return fixed_order_delta(self.kernels.linear, weights, x)


def fixed_order_delta(linear: Any, weights: LoraWeights, x: torch.Tensor) -> torch.Tensor:
    """Both LoRA products by the fixed-order Triton kernel (`triton_kernels.linear`)."""
    return linear(linear(x, weights.lora_A, None), weights.lora_B, None) * weights.scaling
