"""Model setup: make a transformers causal LM ready for packed passes, and read its limits.

Where this sits: once, when an `Engine` wraps a model — before any request flows.
"""

from __future__ import annotations

from typing import Any

from .attention import KEV_ATTENTION


def prepare_model(model: Any) -> None:
    """Switch the model to Kev's packed attention; refuse what that attention cannot do."""
    config = model.config.get_text_config()
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError(
            f"{type(model).__name__} uses sliding-window attention (config.layer_types); "
            "Kev's packed attention supports full attention only"
        )
    if not hasattr(model, "set_attn_implementation") or not model._can_set_attn_implementation():
        raise ValueError(f"{type(model).__name__} does not use transformers' AttentionInterface; Kev cannot pack it")
    model.set_attn_implementation(KEV_ATTENTION)
    model.eval().requires_grad_(False)


def context_length(model: Any, tokenizer: Any) -> int:
    config = model.config.get_text_config()
    length = getattr(config, "max_position_embeddings", None)
    if not length:
        length = getattr(tokenizer, "model_max_length", None)
    if not length or length > 10**8:
        raise ValueError("cannot tell the model's context length (no config.max_position_embeddings)")
    return int(length)


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
