"""Kev's weight layout: what a family's forward reads, built from a checkpoint's tensors by name.

Where this sits: `models.load` reads a checkpoint (a safetensors folder, or a transformers model's
state dict) into these; a platform's ops then add their own layout of each product
(`Ops.prepare`: on CPU the packed panels the kernels read) and may drop the torch one.

Projections that read one input are fused, as every engine that owns its model does: q, k and v
as one `Linear` of widths (q, k, v), gate and up as one of (intermediate, intermediate). A fused
product sums each output exactly as its own would (each output is its own dot product), so the
bits are those of the separate products, in one call instead of three (each call wakes the
threads). `names` keeps each part's checkpoint name: LoRA adapters target the parts by it.

A GGUF read as stored gives quantized parts (`quant.QuantTensor`): a product whose parts all are
keeps them (`Linear.quant`, no dense weight); one that mixes them with dense parts (an F16 part
beside Q4_K ones) has its quantized parts dequantized, and says so on the "kev" logger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .quant import QuantTensor, QuantWeight

log = logging.getLogger("kev")

# checkpoint name → tensor (None: not in the checkpoint; a QuantTensor: a GGUF weight as stored)
Tensors = Callable[[str], "torch.Tensor | QuantTensor | None"]


@dataclass
class Linear:
    """`x @ weight.T + bias` for one or several fused projections of the same input."""

    weight: torch.Tensor | None  # [out_features, in_features]; None once a platform keeps only its own layout
    bias: torch.Tensor | None  # [out_features]
    widths: tuple[int, ...]  # each fused part's outputs, in order
    names: tuple[str, ...]  # each part's checkpoint module name (what a LoRA adapter targets)
    in_features: int
    packed: Any = None  # the platform's own layout of the weight (`Ops.prepare`)
    quant: QuantWeight | None = None  # the weight as a GGUF stores it (then `weight` is None)

    @property
    def out_features(self) -> int:
        return sum(self.widths)

    @classmethod
    def read(cls, tensors: Tensors, names: list[str], dtype: torch.dtype, device: torch.device) -> Linear:
        """The parts `names` (each `<name>.weight`, optionally `<name>.bias`), fused in that order."""
        weights = []
        for name in names:
            weight = tensors(f"{name}.weight")
            if weight is None:
                raise ValueError(f"the checkpoint has no {name}.weight")
            weights.append(weight)
        biases = [_dense(tensors(f"{name}.bias")) for name in names]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            missing = names[[b is None for b in biases].index(True)]
            raise ValueError(f"the checkpoint has biases for some of {names} but not {missing}.bias")
        bias = None if biases[0] is None else _joined([b for b in biases if b is not None], dtype, device)
        widths = tuple(int(w.shape[0]) if isinstance(w, torch.Tensor) else w.rows for w in weights)
        if all(isinstance(w, QuantTensor) for w in weights):
            quant = QuantWeight.of(weights)  # type: ignore[arg-type]
            return cls(None, bias, widths, tuple(names), quant.in_features, quant=quant)
        if any(isinstance(w, QuantTensor) for w in weights):
            log.info("Kev: %s mixes quantized and dense parts; its quantized parts are dequantized", ", ".join(names))
        weight = _joined([_dense(w) for w in weights], dtype, device)  # [out, in]
        return cls(weight, bias, widths, tuple(names), int(weight.shape[1]))


@dataclass
class Layer:
    """One decoder layer's weights, in Kev's layout."""

    index: int
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: Linear  # widths (q, k, v)
    o: Linear
    gate_up: Linear  # widths (intermediate, intermediate)
    down: Linear
    q_norm: torch.Tensor | None = None  # [head_dim]: Qwen3's per-head norms before the rotary
    k_norm: torch.Tensor | None = None
    native: Any = None  # the platform's whole layer as one call (`Ops.prepare`), where it has one
    linears: tuple[Linear, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.linears = (self.qkv, self.o, self.gate_up, self.down)


def read_tensor(tensors: Tensors, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = _dense(tensors(name))
    if tensor is None:
        raise ValueError(f"the checkpoint has no {name}")
    return tensor.to(device=device, dtype=dtype).contiguous()


def _dense(tensor: Any) -> Any:
    """A quantized tensor's values (gguf's dequantization), any other as it is."""
    return tensor.dequantized() if isinstance(tensor, QuantTensor) else tensor


def _joined(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The parts stacked along dim 0 in `dtype` on `device`, as one new contiguous tensor."""
    if len(parts) == 1:
        return parts[0].to(device=device, dtype=dtype).contiguous()
    out = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtype, device=device)
    start = 0
    for part in parts:
        out[start : start + part.shape[0]].copy_(part)  # one part in memory at a time: no second full copy
        start += part.shape[0]
    return out
