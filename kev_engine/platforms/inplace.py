"""Elementwise work in place: the MLP's activation and product, RMSNorm's output.

Where this sits: installed on the model's MLP and RMSNorm modules when an `Engine` wraps a
model by its platform (`Platform.install`), beside `cpu.rows_linear` or `cpu.exact_linear`; removed
when it closes.
On the batch-invariant path the MLP's `silu(gate) * up` is Kev's `silu_mul` kernel (one vector
formula for every element, see csrc/elementwise.cpp) instead of torch's silu and product, and
GLM's fused gate_up MLP gets the same; RMSNorm is Kev's `rms_norm` kernel, one call instead of
six elementwise operations (what a decode step of few rows spends its time on).

Why: a prefill pass of thousands of tokens makes intermediates of tens of MB (RAG-16's 4,968
prompt tokens: [4968, 1536] float32 is 30 MB). An out-of-place op writes a fresh tensor, memory
that is not in cache (and often new pages from the OS); the same op in place rewrites a tensor
just computed, still in cache, which made RAG-16's prefill measurably faster (docs/benchmarks.md,
"Elementwise work in place").

Without the kernel, the results are bitwise what the module's own forward gives: the same
kernels on the same values in the same order (silu in place or not; `a * b` and `b * a` are the
same IEEE product). With the kernels, silu and the product are computed in fp32 and rounded once,
and a norm's squares are summed in the kernel's own fixed order (so within rounding of torch's).

Which modules: instances of the classes listed below (exactly those classes, never a subclass),
whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, GLM's fused
`down_proj(up * act(gate))` or Llama's RMSNorm in the transformers this was written against. A
listed class is checked once per install against its own forward, on one of the model's own
modules and a probe input: bitwise equal, or it keeps its forward (logged) — so a transformers
that rewrites one of them never gets Kev's formula for it. Only an instance whose `forward`
nobody else replaced (accelerate's hooks do) is changed, through an instance attribute; the
class is untouched. The activation is checked at every call: one replaced or hooked since (its
own hook, or one for every module) is called, so torch's silu then, not the kernel; and a tensor
a hook was handed (gate_proj's output, the activation's) is never written over.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.activations import SiLUActivation

_SILU = (SiLUActivation, nn.SiLU)  # plain silu: `F.silu(x, inplace=True)` is the same values
SiluMul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (gate, up, out) rows
RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (rows, weight, eps) -> rows
log = logging.getLogger(__name__)

# transformers.models.<package>.modeling_<package>.<class>; a package this transformers lacks is skipped
MLPS = ("llama.LlamaMLP", "mistral.MistralMLP", "qwen2.Qwen2MLP", "qwen3.Qwen3MLP", "smollm3.SmolLM3MLP",
        "granite.GraniteMLP", "olmo2.Olmo2MLP")
FUSED_MLPS = ("glm.GlmMLP", "glm4.Glm4MLP", "phi3.Phi3MLP")
NORMS = ("llama.LlamaRMSNorm", "mistral.MistralRMSNorm", "qwen2.Qwen2RMSNorm", "qwen3.Qwen3RMSNorm",
         "smollm3.SmolLM3RMSNorm", "granite.GraniteRMSNorm", "olmo2.Olmo2RMSNorm", "glm.GlmRMSNorm",
         "glm4.Glm4RMSNorm", "phi3.Phi3RMSNorm")


def modeling_class(name: str) -> tuple[type, Any] | None:
    """"<package>.<class>" → (the class, its transformers.models.<package>.modeling_<package>
    module), or None where this transformers lacks either."""
    package, cls = name.split(".")
    try:
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    except ImportError:
        return None
    found = getattr(module, cls, None)
    return (found, module) if isinstance(found, type) else None


def _classes(names: tuple[str, ...]) -> set[type]:
    return {found[0] for name in names if (found := modeling_class(name)) is not None}


@functools.cache
def _kinds() -> dict[type, str]:
    kinds = {cls: "mlp" for cls in _classes(MLPS)}
    kinds.update({cls: "fused" for cls in _classes(FUSED_MLPS)})
    kinds.update({cls: "norm" for cls in _classes(NORMS)})
    return kinds


def listed_kind(module: nn.Module) -> str | None:
    """"mlp", "fused" or "norm" for an instance of a listed class (exactly that class), else None."""
    return _kinds().get(type(module))


def computes_listed_formula(module: Any, kind: str) -> bool:
    """Whether the formula Kev replaces a `kind` module's forward with (in torch's ops, torch's
    activation) gives bitwise what the module's own forward gives on a probe input: the check that
    its class still computes what Kev's kernels compute (here and in `cuda.invariant`)."""
    weight = next(module.parameters())
    width = int(module.weight.shape[-1] if kind == "norm" else module.down_proj.out_features)
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(3, width, generator=generator) * 2).to(weight.device, weight.dtype)
    ours = {"mlp": functools.partial(_mlp_forward, module, None), "fused": functools.partial(_glm_mlp_torch, module),
            "norm": functools.partial(_rms_norm_formula, module)}[kind]
    with torch.inference_mode():
        try:
            return torch.equal(ours(x.clone()), type(module).forward(module, x.clone()))
        except Exception:  # noqa: BLE001 - a forward that no longer fits the formula's shapes
            return False


def install(model: nn.Module, silu_mul: SiluMul | None = None, rms_norm: RmsNorm | None = None) -> list[str]:
    """Give the model's listed MLP and RMSNorm modules their in-place forwards (and, with the
    kernel `silu_mul`, the fused MLPs; with `rms_norm`, the norms by that kernel). Returns the MLP
    modules whose activation stays torch's."""
    torch_activations = []
    checked: dict[type, bool] = {}
    for name, module in model.named_modules():
        if "forward" in module.__dict__:
            continue
        kind = listed_kind(module)
        if kind is not None and type(module) not in checked:
            checked[type(module)] = computes_listed_formula(module, kind)
            if not checked[type(module)]:
                log.warning("%s.forward no longer computes what Kev's in-place version does: it keeps its own",
                            type(module).__qualname__)
        if kind is not None and not checked[type(module)]:
            kind = None
        kernel = silu_mul if type(getattr(module, "act_fn", getattr(module, "activation_fn", None))) in _SILU else None
        if kind == "mlp":
            module.forward = functools.partial(_mlp_forward, module, kernel)  # type: ignore[method-assign]
        elif kind == "fused" and kernel is not None:
            module.forward = functools.partial(_glm_mlp_forward, module, kernel)  # type: ignore[method-assign]
        elif kind == "norm":
            if rms_norm is not None:
                module.forward = functools.partial(_rms_norm_kernel, module, rms_norm)  # type: ignore[method-assign]
            else:
                module.forward = functools.partial(_rms_norm_forward, module)  # type: ignore[method-assign]
            continue
        if "mlp" in type(module).__name__.lower() and (kernel is None or "forward" not in module.__dict__):
            torch_activations.append(name or type(module).__name__)
    return torch_activations


def uninstall(model: nn.Module) -> None:
    """Give every module back its class's `forward`."""
    ours = (_mlp_forward, _glm_mlp_forward, _rms_norm_forward, _rms_norm_kernel)
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func in ours:
            del module.forward


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` runs more than its forward: forward hooks of its own or for every module."""
    return bool(module._forward_hooks or module._forward_pre_hooks or torch_module._global_forward_hooks
                or torch_module._global_forward_pre_hooks)


def _plain_silu(act: Any) -> bool:
    """Whether calling `act` is silu and nothing else, so `F.silu` or the kernel may stand in for the
    call: a SiLU module on its class's forward, unhooked (an activation replaced or hooked while the
    engine runs is then called)."""
    return type(act) in _SILU and "forward" not in act.__dict__ and not _hooked(act)


def _mlp_forward(module: Any, silu_mul: SiluMul | None, x: torch.Tensor) -> torch.Tensor:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))` with the activation and product in place. A
    tensor a hook was handed (gate_proj's output, the activation's) may be kept by it: it is never
    written over (the same values go to a new tensor)."""
    gate, up = module.gate_proj(x), module.up_proj(x)
    act_fn = module.act_fn
    if gate is x or gate.dtype != up.dtype or gate.shape != up.shape:  # nothing to write over safely
        return module.down_proj(act_fn(gate) * up)
    kept = _hooked(module.gate_proj)
    if _plain_silu(act_fn):
        if silu_mul is not None and gate.is_contiguous() and up.is_contiguous():
            rows = gate.view(-1, gate.shape[-1])
            out = torch.empty_like(rows) if kept else rows  # [rows, intermediate], over the gate where it may be
            silu_mul(rows, up.view(-1, up.shape[-1]), out)
            return module.down_proj(out.view(gate.shape))
        act = F.silu(gate, inplace=not kept)
    else:
        act = act_fn(gate)
        if _hooked(act_fn) or act is gate:
            return module.down_proj(act * up)
    return module.down_proj(act.mul_(up) if act.dtype == up.dtype and act.shape == up.shape else act * up)


def _glm_mlp_forward(module: Any, silu_mul: SiluMul, x: torch.Tensor) -> torch.Tensor:
    """GLM's `down_proj(up * act(gate))` over one fused `gate_up_proj`, by the kernel (torch's ops
    where the activation is no longer plain silu)."""
    if not _plain_silu(module.activation_fn):
        return _glm_mlp_torch(module, x)
    both = module.gate_up_proj(x)  # [..., 2 * intermediate]: gate, then up
    width = both.shape[-1] // 2
    rows = both.reshape(-1, 2 * width)
    out = rows.new_empty(rows.shape[0], width)
    silu_mul(rows[:, :width], rows[:, width:], out)
    return module.down_proj(out.view(*both.shape[:-1], width))


def _glm_mlp_torch(module: Any, x: torch.Tensor) -> torch.Tensor:
    """The fused MLP's formula in torch's ops: what `_glm_mlp_forward` computes with the kernel."""
    gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
    return module.down_proj(up * module.activation_fn(gate))


def _rms_norm_formula(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm as transformers writes it: the formula every listed norm must compute."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return module.weight * (hidden * torch.rsqrt(variance + module.variance_epsilon)).to(dtype)


def _rms_norm_forward(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm for float32 with one new tensor (the squares', reused for the output) instead of three."""
    if hidden.dtype != torch.float32 or module.weight.dtype != torch.float32:
        return type(module).forward(module, hidden)  # casts to float32 and back: left as written
    squares = hidden.pow(2)
    variance = squares.mean(-1, keepdim=True)
    out = torch.mul(hidden, variance.add_(module.variance_epsilon).rsqrt_(), out=squares)
    return out.mul_(module.weight)


def _rms_norm_kernel(module: Any, rms_norm: RmsNorm, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm by Kev's kernel (one call; its own summation order, the same for every row),
    where the input has the weight's dtype; otherwise as `_rms_norm_forward`."""
    weight = module.weight
    if hidden.dtype != weight.dtype or hidden.device.type != "cpu" or hidden.shape[-1] != weight.shape[0]:
        return _rms_norm_forward(module, hidden)
    rows = hidden.reshape(-1, hidden.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rms_norm(rows, weight, float(module.variance_epsilon)).view(hidden.shape)
