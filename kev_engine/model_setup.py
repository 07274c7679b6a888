"""Model setup: make a transformers causal LM ready for packed passes, and read its limits.

Where this sits: once, when an `Engine` wraps a model — before any request flows.
"""

from __future__ import annotations

import weakref
from typing import Any

from . import cpu_linear, exact_linear, inplace, rotary_table
from .attention import KEV_ATTENTION
from .backends import cuda_invariant

OWNER_ATTR = "_kev_owner"  # weakref to the live Engine serving this model
ORIGINAL_ATTN_ATTR = "_kev_original_attn"


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
    """Give the model back as it came: its own attention, Linear, MLP and norm forwards, no owner.

    (LoRA layers are unwrapped by the adapter pool.)
    """
    original = getattr(model, ORIGINAL_ATTN_ATTR, None)
    if original is not None and original != KEV_ATTENTION:
        model.set_attn_implementation(original)
    for attr in (OWNER_ATTR, ORIGINAL_ATTN_ATTR):
        if attr in model.__dict__:
            object.__delattr__(model, attr)
    cpu_linear.uninstall(model)
    exact_linear.uninstall(model)
    cuda_invariant.uninstall(model)
    rotary_table.uninstall(model)
    inplace.uninstall(model)


def check_packable(model: Any) -> None:
    """Refuse what Kev's packed attention cannot do, before anything about the model changes."""
    config = model.config.get_text_config()
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError(
            f"{type(model).__name__} uses sliding-window attention (config.layer_types); "
            "Kev's packed attention supports full attention only"
        )
    if not hasattr(model, "set_attn_implementation") or not model._can_set_attn_implementation():
        raise ValueError(f"{type(model).__name__} does not use transformers' AttentionInterface; Kev cannot pack it")
    rotary_table.check(model)


def prepare_model(model: Any, kernels: Any = None, exact: bool = False) -> tuple[list[str], Any]:
    """Switch the model to Kev's packed attention and its kernels (`check_packable` first).

    `kernels`: Kev's compiled CPU kernels or None. `exact`: the batch-invariant path — on CPU every
    Linear by the packed product, rotary embeddings from a table, the MLP's activation by the
    kernel; on CUDA (no CPU kernels) Linear and RMSNorm by Triton (`backends.cuda_invariant`).
    Returns the modules left on torch's own elementwise code on the CPU path (for the engine to
    say), and the products LoRA deltas use on the invariant path (None elsewhere).
    """
    if ORIGINAL_ATTN_ATTR not in model.__dict__:  # an engine dropped without close() left it: keep the first
        object.__setattr__(model, ORIGINAL_ATTN_ATTR, model.config._attn_implementation or "sdpa")
    model.set_attn_implementation(KEV_ATTENTION)
    model.eval().requires_grad_(False)
    if exact and kernels is None:  # CUDA: one reduction order per output, by Triton
        return [], cuda_invariant.install(model)
    if exact:
        exact_linear.install(model, kernels)  # every Linear: one summation order at any row count
        left = rotary_table.install(model)
        return left + inplace.install(model, kernels.silu_mul), kernels
    cpu_linear.install(model, kernels.rows_linear if kernels is not None else None)  # few-row products
    inplace.install(model)  # Llama-style MLPs and RMSNorms: elementwise work in place (see inplace)
    return [], None


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
