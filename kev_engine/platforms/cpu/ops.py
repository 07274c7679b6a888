"""Kev's model's ops on CPU: the compiled kernels (csrc/), batch-invariant or fast.

Where this sits: `CpuPlatform.ops()` hands these to Kev's model (`models.llama.DecoderModel.use`).

`ExactOps` (the batch-invariant path, the default where the kernels load, float32 and bfloat16):
every product by `linear_packed` (csrc/linear.cpp: each output summed in one order fixed by K
alone, so a row's result does not depend on how many rows share the call), the weights packed
once into its panels and the torch copies dropped; RMSNorm, the rotary embedding and
`silu(gate) * up` by their kernels (one formula per row or element); and each decoder layer as
one call (`kernels.DecoderLayer`, csrc/layer.cpp: these kernels in this order without returning
to Python) on a pass of the exact pool without LoRA rows. The LoRA deltas by the packed product
too: a row's delta is the same however many rows of its adapter share the pass. Weights kept as
a GGUF stores them (`models.quant`) by `quant_linear`, each row by what it is (the pass's
`prompt` rows): a prompt's rows, and on AMX every row, on the weight decoded (csrc/quant.cpp: the
bits of `linear_packed` on the dequantized weight), a generated token's block-scaled
(csrc/quant_scaled.cpp: each group's scale applied once to its integers' sum with the inputs, never
a weight decoded to a float; every row so without AVX512-BF16); the embedding lookup by `quant_rows`.

`FastOps` (`batch_invariant=False`): torch's BLAS for prefill, Kev's few-row kernel for decode
rows (`rows_linear`), the same elementwise kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from ...adapters.lora import LoraWeights
from ...models.layout import Layer, Linear
from ...models.ops import Ops
from ...models.quant import QuantWeight
from . import rows_linear
from .exact import ExactBackend

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class _KernelElementwise(Ops):
    """RMSNorm, rotary and silu_mul by Kev's kernels in float32 and bfloat16 (torch's in other dtypes)."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES:
            return super().rms_norm(x, weight, eps)
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return self.kernels.rms_norm(rows, weight, eps).view(x.shape)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dtype not in KERNEL_DTYPES:
            return super().rotary(x, cos, sin)
        return self.kernels.rotary(x if x.stride(-1) == 1 else x.contiguous(), cos, sin)

    def silu_mul(self, gate_up: torch.Tensor, width: int) -> torch.Tensor:
        if gate_up.dtype not in KERNEL_DTYPES:
            return super().silu_mul(gate_up, width)
        out = gate_up.new_empty(gate_up.shape[0], width)
        self.kernels.silu_mul(gate_up[:, :width], gate_up[:, width:], out)
        return out


class ExactOps(_KernelElementwise):
    name = "cpu-exact"

    def prepare(self, model: Any) -> None:
        """Each dense product packed once (the torch copy dropped, but the embedding table a tied
        head reads), and each layer's one call built over its products, packed or quantized."""
        self.dtype = model.dtype  # a quantized embedding's rows come out in it
        amx = model.dtype == torch.bfloat16 and self.kernels.bf16_path.path == "amx"  # every row decoded there
        self.prompt_arithmetic = bool(model.quantized()) and self.kernels.quant_prompt_decoded and not amx
        for linear in model.linears():
            if linear.packed is None and linear.quant is None:
                linear.packed = self.kernels.linear_pack(linear.weight)
                if linear.weight is not model.embed:
                    linear.weight = None
        for layer in model.layers:
            layer.native = self._native(layer, model)

    def embedding(self, input_ids: torch.Tensor, table: Any) -> torch.Tensor:
        if not isinstance(table, QuantWeight):
            return super().embedding(input_ids, table)
        rows = self.kernels.quant_rows(table.tiled[0], table.types[0], table.out_features, table.in_features,
                                       input_ids)
        return rows.to(self.dtype)

    def _native(self, layer: Layer, model: Any) -> Any:
        q, k, v = layer.qkv.widths
        qkv, o, gate_up, down = (self._product(linear) for linear in layer.linears)
        return self.kernels.DecoderLayer(
            layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, [model.eps] * 4, qkv, layer.qkv.bias,
            o, layer.o.bias, gate_up, layer.gate_up.bias, down, layer.down.bias, [q, k, v, model.intermediate],
            model.head_dim, model.hidden, float(model.scaling))

    def _product(self, linear: Linear) -> Any:
        if linear.quant is not None:
            return self.kernels.Product.quantized(linear.quant.tiled, linear.quant.types, linear.quant.widths)
        return self.kernels.Product.packed(linear.packed, linear.out_features)

    def linear(self, x: torch.Tensor, linear: Linear, prompt: torch.Tensor | None = None) -> torch.Tensor:
        if linear.quant is not None:
            q = linear.quant
            return self.kernels.quant_linear(x, q.tiled, q.types, q.widths, linear.bias, prompt=prompt)
        return self.kernels.linear_packed(x, linear.packed, linear.out_features, linear.bias)

    def layers(self, layers: list[Layer], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Any,
               batch: Any) -> torch.Tensor | None:
        """The layers in one call (`layers_forward`: no return to Python between them, the
        interpreter's lock released throughout; csrc/layer.cpp)."""
        if type(backend) is not ExactBackend or batch.slot_blocks is None:
            return None
        if any(layer.native is None for layer in layers):
            return None
        pool, tables = backend.pool, batch.attention
        return self.kernels.layers_forward([layer.native for layer in layers], hidden, cos, sin,
                                           [pool.keys[layer.index] for layer in layers],
                                           [pool.values[layer.index] for layer in layers], batch.slot_blocks,
                                           batch.slot_offsets, tables.block_tables, batch.cu_seqlens, tables.past_lens,
                                           batch.prompt)

    def lora_products(self, weights: LoraWeights, x: torch.Tensor) -> torch.Tensor:
        return packed_delta(self.kernels, weights, x)


def packed_delta(kernels: Any, weights: LoraWeights, x: torch.Tensor) -> torch.Tensor:
    """Both LoRA products by the packed kernel: a row's delta is the same however many rows of its
    adapter share the pass (A and B packed once per adapter). x [n, in] → [n, out]."""
    if weights.packed is None:
        weights.packed = (kernels.linear_pack(weights.lora_A), kernels.linear_pack(weights.lora_B))
    low = kernels.linear_packed(x.contiguous(), weights.packed[0], weights.lora_A.shape[0])  # [n, r]
    return kernels.linear_packed(low, weights.packed[1], weights.lora_B.shape[0]) * weights.scaling


class FastOps(_KernelElementwise):
    name = "cpu-fast"

    def linear(self, x: torch.Tensor, linear: Linear, prompt: torch.Tensor | None = None) -> torch.Tensor:
        """Few rows (float32) by Kev's row kernel, else torch's BLAS."""
        assert linear.weight is not None
        if (x.dtype == torch.float32 and x.shape[0] <= rows_linear.KERNEL_ROWS and linear.in_features % 8 == 0
                and linear.weight.is_contiguous()):
            out = self.kernels.rows_linear(x, linear.weight)
            return out + linear.bias if linear.bias is not None else out
        return torch.nn.functional.linear(x, linear.weight, linear.bias)
