"""Per-call settings for LlamaIndex code that passes no kwargs to the LLM.

Query engines, synthesizers and sub-question engines call `llm.predict` / `llm.apredict` with
no settings of their own, so a per-query adapter, temperature or reply constraint has to travel
beside the call:

    with scoped(adapter="legal", temperature=0.0):
        engine.query("...")            # every Kev call inside uses these settings
    with scoped(regex=r"(yes|no)"):
        engine.query("...")            # every reply inside matches the regex

The settings live in a `ContextVar`. asyncio tasks copy the context when they are created, and
LlamaIndex's `asyncio_run` (the fresh loop behind sync `use_async=True` paths, run on a helper
thread when a loop is already running) copies it too, so the scope reaches every fanned-out call.
A thread you start yourself does not inherit it: run its target in `contextvars.copy_context()`,
or give that thread an LLM copy made with `Kev.with_settings(...)`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

from kev_engine import CONSTRAINT_FIELDS

from ..init_args import SETTING_KEYS

# what a field, a `scoped` block or a call may set, the same names everywhere: every setting but n
# (a LlamaIndex call answers once)
LLAMAINDEX_KEYS = tuple(key for key in SETTING_KEYS if key != "n")

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_overrides: ContextVar[Mapping[str, Any]] = ContextVar("kev_llamaindex_overrides", default=_EMPTY)


def check_settings(settings: Mapping[str, Any], where: str = "setting") -> None:
    """Refuse names Kev does not know, naming them and the allowed ones."""
    unknown = sorted(set(settings) - set(LLAMAINDEX_KEYS))
    if unknown:
        raise ValueError(f"unknown Kev {where}(s) {unknown}; allowed: {list(LLAMAINDEX_KEYS)}")


def constrains(settings: Mapping[str, Any]) -> bool:
    """Whether `settings` constrain the reply (a constraint set to None or False is none)."""
    return any(settings.get(name) not in (None, False) for name in CONSTRAINT_FIELDS)


def merge_settings(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Layers of settings, farthest first (fields, scopes, the call): each setting from the
    closest layer that gives it. A reply takes one constraint, so a layer that constrains the
    reply replaces every constraint of the layers before it instead of joining them: a call's
    `json_schema` (structured_predict) or bound tools win over a scope's `regex`."""
    merged: dict[str, Any] = {}
    for layer in layers:
        if constrains(layer):
            for name in CONSTRAINT_FIELDS:
                merged.pop(name, None)
        merged.update(layer)
    return merged


@contextmanager
def scoped(**settings: Any) -> Iterator[None]:
    """Apply `settings` (adapter, temperature, top_p, top_k, max_tokens, stop, seed, the
    penalties..., or one reply constraint — json_schema, json_object, regex, choice, grammar,
    structural_tag: `LLAMAINDEX_KEYS`) to every Kev call made inside the block. Nested scopes merge,
    the inner one winning (an inner constraint replaces an outer one); call kwargs still win over
    the scope, and the scope over the LLM's own fields."""
    check_settings(settings)
    token = _overrides.set(MappingProxyType(merge_settings(_overrides.get(), settings)))
    try:
        yield
    finally:
        _overrides.reset(token)


def current_overrides() -> Mapping[str, Any]:
    """The settings of the innermost active `scoped` block (empty outside any)."""
    return _overrides.get()
