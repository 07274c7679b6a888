"""Batch-invariant Linear layers: every `nn.Linear` product by Kev's packed kernel, at any row count.

Where this sits: installed on the model's Linear layers when an `Engine` runs batch-invariant on
CPU (`CpuPlatform.install`), removed when it closes. LoRA deltas use the same product
(`lora.LoraRouter`).

Why: a question's rows meet the weights in a prefill of 5,000 rows, a decode step of 16 or alone;
BLAS sums each dot product in an order chosen by that shape, so its results move with the pack.
`linear_packed` (csrc/linear.cpp) sums every output element in one order fixed by K alone.

The weight is packed once, when the engine starts, into the kernel's layout (panels of 16
outputs), beside the layer's own weight, which stays as it is: the model's state_dict, a tied
input embedding, code that copies or saves the model all keep working while the engine serves.
The cost is a second copy of the Linear weights in memory (`batch_invariant=False` has none);
a weight changed after the engine started is not seen by it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class PackedWeight:
    """A weight [out_features, in_features] in linear_packed's layout."""

    packed: torch.Tensor
    out_features: int
    in_features: int


def eligible(module: nn.Module) -> bool:
    """A plain Linear on the CPU in a dtype the kernel computes, whose forward nobody replaced."""
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and module.weight.device.type == "cpu"
        and module.weight.dtype in DTYPES
    )


def uncovered(model: nn.Module) -> list[str]:
    """Linear-like layers the packed product cannot serve (their names): nothing else may be left."""
    if not isinstance(model, nn.Module):  # Kev's own model: every product and norm is its ops'
        return []
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not eligible(module) and not _is_ours(module.__dict__.get("forward")):
            names.append(name or type(module).__name__)
    return names


def install(model: nn.Module, kernels: Any) -> None:
    """Give every eligible Linear layer the packed product (`kernels`: a `kernels.Kernels`)."""
    for module in model.modules():
        if not isinstance(module, nn.Linear) or not eligible(module):
            continue
        weight = module.weight.detach()
        packed = PackedWeight(kernels.linear_pack(weight), weight.shape[0], weight.shape[1])
        module.forward = functools.partial(_forward, module, packed, kernels.linear_packed)  # type: ignore[method-assign]


def uninstall(model: nn.Module) -> None:
    """Every layer back as it came: its own forward (the packed copies go with it)."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and _is_ours(module.__dict__.get("forward")):
            del module.forward


def _is_ours(forward: Any) -> bool:
    return isinstance(forward, functools.partial) and forward.func is _forward


def _forward(layer: nn.Linear, weight: PackedWeight, product: Any, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` by the packed kernel: x [..., in] → [..., out]."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != weight.packed.dtype:
        raise TypeError(f"{type(layer).__name__} of {weight.packed.dtype} got input of {rows.dtype}")
    out = product(rows, weight.packed, weight.out_features, layer.bias)
    return out.view(*x.shape[:-1], weight.out_features)
