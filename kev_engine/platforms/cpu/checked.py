"""Installing a forward on the instances of listed transformers classes, each class checked first.

Where this sits: `attention_forward` (attention modules) and `layer_forward` (decoder layers)
install through it. Why: a forward Kev writes for a transformers class is only right while that
class still computes what it was written against. So each class is checked once per install, on
one of the model's own modules and a probe pack of 3 tokens, against its own forward: bitwise
equal, or every instance keeps its own, logged with the reason — a transformers release that
rewrites the class never gets Kev's version of it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...model.pack import Segment, pack

Forward = Callable[..., Any]
log = logging.getLogger("kev")


def install(model: nn.Module, forward_for: Callable[[Any], Forward | None],
            first: Callable[[Any], torch.Tensor], what: str) -> None:
    """Give each module for which `forward_for` makes a forward (None: leave it) that forward,
    where its class passed the probe. `first` picks a forward's result out of its return value
    (an attention module returns (output, weights)); `what` names the forward in the warning."""
    checked: dict[type, bool] = {}
    for module in model.modules():
        if "forward" in module.__dict__:
            continue
        forward = forward_for(module)
        if forward is None:
            continue
        cls = type(module)
        if cls not in checked:
            why = _differs_from_own(module, forward, first)
            checked[cls] = why is None
            if why is not None:
                log.warning("%s keeps its own forward, not %s: %s", cls.__qualname__, what, why)
        if checked[cls]:
            module.forward = forward  # type: ignore[method-assign]


def uninstall(model: nn.Module, func: Forward) -> None:
    """Every module whose forward is a partial of `func` back to its class's forward."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func is func:
            del module.forward


def probe(attention: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Hidden states, cos/sin and a pack (no KV memory) of 3 tokens, for a module whose attention
    is `attention`, in its weights' device and dtype."""
    weight, config = attention.q_proj.weight, attention.config
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 3, config.hidden_size, generator=generator).to(weight.device, weight.dtype)
    dim = int(attention.head_dim)
    cos, sin = (torch.randn(1, 3, dim, generator=generator).to(weight.device, weight.dtype) for _ in range(2))
    pass_ = pack([Segment(request_id=0, token_ids=[0, 0, 0], past_len=0, needs_logits=False)], weight.device)
    return hidden, {"position_embeddings": (cos, sin), "attention_mask": None, "kev_pack": pass_}


def _differs_from_own(module: Any, forward: Forward, first: Callable[[Any], torch.Tensor]) -> str | None:
    """`forward` against the class's own on the probe: None where they agree, else why not."""
    hidden, kwargs = probe(getattr(module, "self_attn", module))
    with torch.inference_mode():
        try:
            ours = first(forward(hidden, **kwargs))
        except Exception as exc:  # noqa: BLE001 - a forward that no longer fits the class's arguments
            return f"Kev's version raised {type(exc).__name__}: {exc}"
        try:
            own = first(type(module).forward(module, hidden, **kwargs))
        except Exception as exc:  # noqa: BLE001 - the class itself fails on the probe: nothing to compare
            return f"its own forward raised {type(exc).__name__} on the probe: {exc}"
    return differs(ours, own)


def differs(ours: torch.Tensor, own: torch.Tensor) -> str | None:
    """None where `ours` is bitwise `own`, else a reason naming the largest difference. Kev's
    forwards are installed only in the dtypes whose kernels round as torch does (float32, bfloat16)."""
    if ours.shape != own.shape or ours.dtype != own.dtype:
        return f"it returns {tuple(ours.shape)} {ours.dtype} where the class returns {tuple(own.shape)} {own.dtype}"
    if torch.equal(ours, own):
        return None
    gap = (ours.float() - own.float()).abs().max().item()
    return f"its results differ by up to {gap:.3g} in {own.dtype} (a transformers release that computes otherwise)"
