"""Batch invariance on CUDA: every Linear and RMSNorm by a fixed-order Triton kernel, attention unsplit.

Where this sits: installed on the model when a CUDA `Engine` runs batch-invariant
(`CudaPlatform.install`), removed when it closes; the counterpart of `cpu.exact_linear` and
`rotary_table` on CPU. The reductions of a pass, and what makes each one independent of the pack:
  - Linear products (the output head and LoRA deltas too): `triton_kernels.linear`, tiles and K
    chunks set by the weight's shape, one K order for every row count (cuBLAS would choose both
    by the row count);
  - RMSNorm (the layers', and Qwen3's per-head q/k norms): `triton_kernels.rms_norm`, one program
    per row (torch's reduction would lay its threads out by the number of rows);
  - attention: torch's varlen_attn with `num_splits=1` (`varlen`), each query's keys in
    one thread block in one order, or Kev's Triton attention (`triton_attention`), one order by
    construction;
  - rotary cos/sin (a K=1 product and elementwise functions), residuals, the MLP's activation:
    elementwise, one formula per element, whatever the shape.
Which modules: plain `nn.Linear`s and the RMSNorm classes `inplace` lists, each instance checked
to compute Llama's RMSNorm on a probe input (`inplace.computes_listed_formula`); any other Linear
or norm is named by `uncovered`, and the engine then refuses (batch_invariant=True) or says it is
not invariant (None).

Triton ships with torch's CUDA builds on Linux, so this adds nothing to install there; elsewhere
the engine says why it is not batch-invariant. Under `TRITON_INTERPRET=1` the same path runs on
CPU tensors (tests/test_cuda_triton.py): its plumbing, not the GPU's arithmetic; `make gpu-check`
tests it on a GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import inplace

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_or_why() -> tuple[Any, str | None]:
    """Kev's Triton kernels (`triton_kernels`), or (None, why they cannot load)."""
    try:
        from . import triton_kernels as cuda_triton
    except Exception as exc:  # noqa: BLE001 - Triton missing, or built for another torch
        return None, f"Triton cannot be imported ({type(exc).__name__}: {exc}); install triton"
    return cuda_triton, None


def _is_rms_norm(module: nn.Module) -> bool:
    return inplace.listed_kind(module) == "norm" and inplace.computes_listed_formula(module, "norm")


def _eligible_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and "forward" not in module.__dict__ and module.weight.dtype in DTYPES


def uncovered(model: nn.Module) -> list[str]:
    """Linear layers and norms the kernels cannot serve: each would reduce in a pack-dependent order."""
    if not isinstance(model, nn.Module):  # Kev's own model: every product and norm is its ops'
        return []
    names = []
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if _is_ours(forward):
            continue
        if isinstance(module, nn.Linear) and not _eligible_linear(module):
            names.append(name or type(module).__name__)
        elif "norm" in type(module).__name__.lower() and not (_is_rms_norm(module) and forward is None):
            names.append(name or type(module).__name__)
    return names


def why_not(model: nn.Module, paged: Any) -> str | None:
    """Why a CUDA model cannot run batch-invariant, or None when it can."""
    if paged is None or paged.name not in ("varlen", "triton"):
        return ("batch invariance on CUDA needs torch's varlen_attn (num_splits=1) or Kev's Triton attention; "
                "this engine has neither")
    device = next(model.parameters()).device
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the model is on {device}; Kev's Triton kernels run on CUDA (on CPU only under TRITON_INTERPRET=1)"
    kernels, why = triton_or_why()
    if why is not None:
        return why
    dtype = next(model.parameters()).dtype
    if dtype not in DTYPES:
        return f"the model is in {dtype}; the Triton kernels compute float32, bfloat16 and float16"
    left = uncovered(model)
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        return f"these layers cannot take Kev's fixed-order CUDA kernels: {shown}"
    return None


Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def install(model: nn.Module) -> Linear:
    """Give every plain Linear and Llama-style RMSNorm the Triton forward (`why_not` first); return
    the fixed-order product, for the LoRA deltas."""
    kernels, why = triton_or_why()
    if why is not None:
        raise RuntimeError(why)
    for module in model.modules():
        if "forward" in module.__dict__:
            continue
        if isinstance(module, nn.Linear) and _eligible_linear(module):
            module.forward = functools.partial(_linear_forward, module, kernels.linear)  # type: ignore[method-assign]
        elif _is_rms_norm(module):
            module.forward = functools.partial(_rms_norm_forward, module, kernels.rms_norm)  # type: ignore[method-assign]
    return kernels.linear  # type: ignore[no-any-return]


def uninstall(model: nn.Module) -> None:
    """Every module back as it came."""
    for module in model.modules():
        if _is_ours(module.__dict__.get("forward")):
            del module.forward


def _is_ours(forward: Any) -> bool:
    return isinstance(forward, functools.partial) and forward.func in (_linear_forward, _rms_norm_forward)


def _linear_forward(layer: nn.Linear, linear: Any, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != layer.weight.dtype:
        raise TypeError(f"{type(layer).__name__} of {layer.weight.dtype} got input of {x.dtype}")
    return linear(x, layer.weight, layer.bias)


def _rms_norm_forward(module: Any, rms_norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden, module.weight, module.variance_epsilon)
