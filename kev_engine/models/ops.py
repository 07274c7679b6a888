"""The ops a family's forward is written in, and their reference: torch's own functions.

Where this sits: `llama.DecoderModel.forward` calls nothing else. Each platform implements these
over its kernels (`platforms.*.ops`: on CPU Kev's compiled kernels, on CUDA Triton's fixed-order
products) and hands the model its ops once (`DecoderModel.use`); this class is the reference,
and the ops of every device torch runs on without kernels of Kev's. The formulas are
transformers' (RMSNorm in float32 then the weight in the model's dtype, `rotate_half`, SiLU), so
Kev's forward computes what the family's modeling code computes, up to each kernel's summation
order.

Attention is the engine's attention backend's (`platforms.base.AttentionBackend`): every new
token's keys/values into the paged pool first, then every segment over its own keys.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..adapters.lora import LoraRoutes, LoraWeights, add_delta, torch_delta
from .layout import Layer, Linear


class Ops:
    """torch's ops; subclasses override what their device computes otherwise."""

    name = "torch"
    # Whether a prompt's rows of a product take another arithmetic than a generated token's (Kev's
    # CPU products on a GGUF's blocks: csrc/quant.cpp): each row's bits then depend on what it is,
    # so a generated token's keys and values are not a later prompt's (`Scheduler.keys_answers`).
    prompt_arithmetic = False

    def prepare(self, model: Any) -> None:
        """Put each weight in this platform's layout, once, before the first pass (nothing here:
        torch computes dense weights; a model holding a GGUF's quantized weights is refused)."""
        if model.quantized():
            raise ValueError(
                f"this model holds a GGUF's quantized weights as stored, which Kev computes on its batch-invariant "
                f"CPU kernels; this engine computes with {self.name}'s ops. Load it with weights='dense', or on "
                "the CPU with batch_invariant left on and cpu_kernels not 'torch'")

    def embedding(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → [T, hidden]."""
        return F.embedding(input_ids, table)

    def linear(self, x: torch.Tensor, linear: Linear, prompt: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] → [T, out]. `prompt` (bool [T], or None: no row): the rows that are a prompt's
        tokens, for ops whose arithmetic depends on it (`prompt_arithmetic`); the others ignore it."""
        return F.linear(x, linear.weight, linear.bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Each row of x [..., width] normalised in float32, then times the weight in x's dtype."""
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and the norm after it: (x + delta, rms_norm(x + delta)). Platforms may
        fuse the two; the sum's bits stay torch's add's."""
        total = x + delta
        return total, self.rms_norm(total, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by its rows' cos, sin [T, D]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None] + rotated * sin[:, None]

    def rotary_qk(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotary` of a layer's queries [T, heads, D] and keys [T, kv_heads, D]; platforms may
        rotate both in one call."""
        return self.rotary(query, cos, sin), self.rotary(key, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor, width: int) -> torch.Tensor:
        """gate_up [T, 2 * width] → silu(gate) * up [T, width]."""
        gate, up = gate_up.split(width, dim=-1)
        return F.silu(gate) * up

    def layers(self, layers: list[Layer], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Any,
               batch: Any) -> torch.Tensor | None:
        """Consecutive whole layers as one platform call where there is one (`Layer.native`), else
        None: the forward then calls the ops one by one, layer by layer."""
        return None

    def lora_products(self, weights: LoraWeights, x: torch.Tensor) -> torch.Tensor:
        """`B(A(x)) * scaling` for rows x [n, in] in the adapter's dtype → [n, out]."""
        return torch_delta(weights, x)

    def with_lora(self, out: torch.Tensor, x: torch.Tensor, linear: Linear, routes: LoraRoutes) -> torch.Tensor:
        """Each adapter's delta added to its own rows of `out` [T, out], part by part of a fused
        product (`lora.add_delta`)."""
        for adapter, rows in routes:
            start = 0
            for name, width in zip(linear.names, linear.widths):
                weights = adapter.modules.get(name)
                if weights is not None:
                    add_delta(out[:, start : start + width], x, rows, weights, self.lora_products)
                start += width
        return out
