"""Kev's own models: one explicit forward per family, over the ops each platform implements.

    checkpoint ─ load.py ─► layout.py (fused qkv, gate_up) ─► llama.py forward ─► ops.py (torch's,
                                                                                  or a platform's)

`model_impl` chooses the implementation, with vLLM's names: "kev" (Kev's forward, or an error
naming the families it has), "transformers" (the transformers model itself, through Kev's
attention: the named fallback, where forward hooks and replaced modules are honoured), "auto"
(Kev's where the family is Kev's, else the fallback).
"""

from __future__ import annotations

from typing import Any

from .llama import DecoderModel
from .load import FAMILIES, dense_bytes, from_folder, from_gguf, from_module, owned
from .ops import Ops

IMPLS = ("auto", "kev", "transformers")

__all__ = ["FAMILIES", "IMPLS", "DecoderModel", "Ops", "choose_impl", "dense_bytes", "from_folder", "from_gguf",
           "from_module",
           "owned"]


def choose_impl(model_impl: str | None, config: Any) -> str:
    """"kev" or "transformers" for a model of `config` (None: "auto")."""
    impl = "auto" if model_impl is None else model_impl
    if impl not in IMPLS:
        raise ValueError(f"model_impl={model_impl!r} is not allowed; use one of {list(IMPLS)}")
    why_not = owned(config)
    if impl == "kev" and why_not is not None:
        raise ValueError(f"model_impl='kev' cannot serve this model: {why_not}. Use model_impl='transformers' "
                         "(or 'auto') to run it on transformers' modeling code")
    if impl == "auto":
        return "kev" if why_not is None else "transformers"
    return impl
