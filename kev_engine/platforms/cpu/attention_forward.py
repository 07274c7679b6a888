"""Llama-style attention modules with their rotary embedding in one kernel call.

Where this sits: installed on the model's attention modules by the CPU platform where Kev's kernels
load (`cpu.platform`), removed when the engine closes (`platforms.uninstall`).

Why: transformers' `apply_rotary_pos_emb` is six elementwise operations per tensor (two slices, a
negation, a concatenation, two products and a sum); a decode step of few rows spends more time
dispatching them, for every layer, than computing them. Kev's `rotary` kernel computes the same
formula with the same roundings in one call for the queries and one for the keys, so the module
gives bitwise what its own forward gives.

Which modules: instances of the classes listed below (exactly those classes) in float32 or bfloat16
(the kernel's dtypes), each class checked once per install against its own forward on one of the
model's modules and a probe input: bitwise equal, or it keeps its forward (logged, with why). An
instance whose `forward` someone else replaced is left alone; a call with a transformers cache, or
whose cos/sin are not one row per token in the input's dtype, runs the class's own forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..inplace import modeling_class
from . import checked

DTYPES = (torch.float32, torch.bfloat16)  # what the rotary kernel computes
Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x [T, H, D], cos, sin [T, D])

# transformers.models.<package>.modeling_<package>.<class>: where its `sliding_window` argument comes from
CLASSES = {"llama.LlamaAttention": None, "mistral.MistralAttention": "config", "qwen2.Qwen2Attention": "module",
           "qwen3.Qwen3Attention": "module"}


@functools.cache
def _listed() -> dict[type, tuple[str | None, Callable[..., Any]]]:
    """Each listed class this transformers has: where its sliding window comes from, and the eager
    attention its forward falls back to (its modeling file's)."""
    found: dict[type, tuple[str | None, Callable[..., Any]]] = {}
    for name, window in CLASSES.items():
        listed = modeling_class(name)
        eager = getattr(listed[1], "eager_attention_forward", None) if listed is not None else None
        if listed is not None and callable(eager):
            found[listed[0]] = (window, eager)
    return found


def install(model: nn.Module, rotary: Rotary) -> None:
    """Give the listed attention modules the forward whose rotary is `rotary` (the kernel)."""
    def forward_for(module: Any) -> Callable[..., Any] | None:
        listed = _listed().get(type(module))
        if listed is None or module.q_proj.weight.dtype not in DTYPES:  # float16: the class's own rotary
            return None
        return functools.partial(_forward, module, rotary, *listed)

    checked.install(model, forward_for, lambda out: out[0], "Kev's rotary kernel")


def uninstall(model: nn.Module) -> None:
    checked.uninstall(model, _forward)


def _forward(module: Any, rotary: Rotary, window: str | None, eager: Callable[..., Any],
             hidden_states: torch.Tensor,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
             attention_mask: torch.Tensor | None = None, cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The listed classes' forward, the rotary by the kernel: [B, T, hidden] → ([B, T, hidden], weights)."""
    dtype, input_shape = hidden_states.dtype, hidden_states.shape[:-1]
    if (cache is not None or kwargs.get("past_key_values") is not None or position_embeddings is None
            or any(t.dtype != dtype or t.shape[:-1] != input_shape for t in position_embeddings)):
        return type(module).forward(module, hidden_states, position_embeddings=position_embeddings,
                                    attention_mask=attention_mask, cache=cache, **kwargs)
    hidden_shape = (*input_shape, -1, module.head_dim)
    query = module.q_proj(hidden_states).view(hidden_shape)
    key = module.k_proj(hidden_states).view(hidden_shape)
    if hasattr(module, "q_norm"):  # Qwen3: per-head norms before the rotary
        query, key = module.q_norm(query), module.k_norm(key)
    value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = (t.reshape(-1, t.shape[-1]) for t in position_embeddings)  # [B * T, D]
    query = _rotate(rotary, query, cos, sin).transpose(1, 2)
    key = _rotate(rotary, key, cos, sin).transpose(1, 2)
    if window is not None:
        kwargs["sliding_window"] = module.sliding_window if window == "module" else getattr(
            module.config, "sliding_window", None)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager)
    out, weights = interface(module, query, key, value, attention_mask,
                             dropout=0.0 if not module.training else module.attention_dropout,
                             scaling=module.scaling, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return module.o_proj(out), weights


def _rotate(rotary: Rotary, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated by its rows' cos/sin [B * T, D] (the kernel takes [rows, heads, D] with each head's D
    contiguous; cos and sin contiguous)."""
    rows = x.reshape(-1, x.shape[-2], x.shape[-1])
    return rotary(rows.contiguous(), cos.contiguous(), sin.contiguous()).view(x.shape)
