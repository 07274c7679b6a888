"""Per-call settings for LlamaIndex code that passes no kwargs to the LLM.

Query engines, synthesizers and sub-question engines call `llm.predict` / `llm.apredict` with
no settings of their own, so a per-query adapter or temperature has to travel beside the call:

    with scoped(adapter="legal", temperature=0.0):
        engine.query("...")            # every Kev call inside uses these settings

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

from kev_engine.params import CONSTRAINT_FIELDS, SETTING_FIELDS

# every engine setting but the constraints (per call, below) and n (LlamaIndex answers once),
# derived so a new engine setting reaches LlamaIndex too
SAMPLING_KEYS = tuple(name for name in SETTING_FIELDS if name != "n")
SETTING_KEYS = (*SAMPLING_KEYS, "adapter")
# a reply constraint belongs to one call (its schema, its tools), never to a scope or a field
CALL_KEYS = (*SETTING_KEYS, *CONSTRAINT_FIELDS)

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_overrides: ContextVar[Mapping[str, Any]] = ContextVar("kev_llamaindex_overrides", default=_EMPTY)


def check_settings(
    settings: Mapping[str, Any], where: str = "setting", allowed: tuple[str, ...] = SETTING_KEYS
) -> None:
    """Refuse names Kev does not know, naming them and the allowed ones."""
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(f"unknown Kev {where}(s) {unknown}; allowed: {list(allowed)}")


@contextmanager
def scoped(**settings: Any) -> Iterator[None]:
    """Apply `settings` (adapter, temperature, top_p, top_k, max_tokens, stop, seed, the
    penalties...: `SETTING_KEYS`) to every Kev call made inside the block. Nested scopes merge,
    the inner one winning; call kwargs still win over the scope, and the scope over the LLM's
    own fields."""
    check_settings(settings)
    token = _overrides.set(MappingProxyType({**_overrides.get(), **settings}))
    try:
        yield
    finally:
        _overrides.reset(token)


def current_overrides() -> Mapping[str, Any]:
    """The settings of the innermost active `scoped` block (empty outside any)."""
    return _overrides.get()
