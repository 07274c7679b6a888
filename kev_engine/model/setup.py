"""Model setup: make a transformers causal LM ready for packed passes, and read its limits.

Where this sits: once, when an `Engine` wraps a model — before any request flows. What the
device's kernels install on the model is the platform's (`Platform.install`, `platforms.uninstall`).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from . import rotary
from .attention import KEV_ATTENTION

OWNER_ATTR = "_kev_owner"  # weakref to the live Engine serving this model
ORIGINAL_ATTN_ATTR = "_kev_original_attn"
UNSUPPORTED_FIELDS = ("attn_logit_softcapping",)  # Gemma 2: scores soft-capped inside attention
SINK_PARAMETERS = ("sinks",)  # GPT-OSS: a learnt logit per head beside the keys


def claim_model(model: Any, engine: Any) -> None:
    """One live engine per model object: a second would wrap its layers under the first's router."""
    owner_ref = getattr(model, OWNER_ATTR, None)
    owner = owner_ref() if owner_ref is not None else None
    if owner is not None and not owner.closed:
        raise ValueError(
            f"this {type(model).__name__} object already serves a live Engine ({owner.name!r}); "
            "close() that engine first, or load another copy of the model"
        )
    object.__setattr__(model, OWNER_ATTR, weakref.ref(engine))


def release_model(model: Any) -> None:
    """Give the model back its own attention and no owner (the platform's forwards come off by
    `platforms.uninstall`, LoRA layers by the adapter pool)."""
    original = getattr(model, ORIGINAL_ATTN_ATTR, None)
    if original is not None and original != KEV_ATTENTION:
        model.set_attn_implementation(original)
    for attr in (OWNER_ATTR, ORIGINAL_ATTN_ATTR):
        if attr in model.__dict__:
            object.__delattr__(model, attr)


def check_packable(model: Any, context: int) -> None:
    """Refuse what Kev's packed attention cannot compute, before anything about the model changes,
    so a model never loads to fail every request: a sliding window narrower than `context` (the
    engine's context length), soft-capped attention scores; of a transformers model also attention
    sinks, a model outside transformers' AttentionInterface, rope types a pack cannot share."""
    name = type(model).__name__
    window = attention_window(model.config.get_text_config())
    if window is not None and window[0] < context:
        size, field = window
        raise ValueError(
            f"{name} attends within a sliding window of {size} tokens (config.{field}), but its context is "
            f"{context} tokens; Kev's packed attention has no window. Pass max_model_len={size} (or less) "
            "to serve it with a context the window never cuts"
        )
    for field in UNSUPPORTED_FIELDS:
        value = getattr(model.config.get_text_config(), field, None)
        if value is not None:
            raise ValueError(f"{name} sets config.{field}={value!r}; Kev's packed attention does not "
                             "soft-cap attention scores")
    if not isinstance(model, nn.Module):  # Kev's own model: its rope was checked when it was built
        return
    sinks = [key for key, _ in model.named_parameters() if key.rsplit(".", 1)[-1] in SINK_PARAMETERS]
    if sinks:
        raise ValueError(f"{name} has attention sinks ({sinks[0]}); Kev's packed attention has none")
    if not hasattr(model, "set_attn_implementation") or not model._can_set_attn_implementation():
        raise ValueError(f"{name} does not use transformers' AttentionInterface; Kev cannot pack it")
    rotary.check(model)


def attention_window(config: Any) -> tuple[int, str] | None:
    """The narrowest sliding window any layer attends within, and the config field that sets it,
    or None where every layer attends to its whole context. `layer_types` (Qwen2/3, Gemma, GPT-OSS)
    says which layers slide; without it a set `sliding_window` applies to every layer (Mistral,
    Phi-3), unless `use_sliding_window` is False."""
    size = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        sliding = [kind for kind in layer_types if "sliding" in str(kind)]
        if not sliding:
            return None
        if not isinstance(size, int):
            raise ValueError(f"config.layer_types has {sliding[0]!r} layers but config.sliding_window is {size!r}; "
                             "Kev cannot tell their window")
        return size, "sliding_window"
    if size is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(size), "sliding_window"


def prepare_model(model: Any) -> None:
    """Switch the model to Kev's packed attention (`check_packable` first)."""
    if ORIGINAL_ATTN_ATTR not in model.__dict__:  # an engine dropped without close() left it: keep the first
        object.__setattr__(model, ORIGINAL_ATTN_ATTR, model.config._attn_implementation or "sdpa")
    model.set_attn_implementation(KEV_ATTENTION)
    model.eval().requires_grad_(False)


def context_length(model: Any, tokenizer: Any, max_model_len: int | None = None) -> int:
    """The engine's context: the model's (`max_position_embeddings`, else the tokenizer's), or
    `max_model_len` where that is shorter (vLLM's name)."""
    config = model.config.get_text_config()
    length = getattr(config, "max_position_embeddings", None)
    if not length:
        length = getattr(tokenizer, "model_max_length", None)
    if not length or length > 10**8:
        raise ValueError("cannot tell the model's context length (no config.max_position_embeddings)")
    if max_model_len is None:
        return int(length)
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 2 <= max_model_len <= length:
        raise ValueError(f"max_model_len={max_model_len!r} is not allowed; give an int from 2 to the model's "
                         f"context, {length}")
    return max_model_len


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
