"""One engine per (source, device, dtype), shared by every LLM object that names it.

LangChain and LlamaIndex copy LLM objects freely (`bind`, `configurable_fields`, `model_copy`),
so construction must be cheap: the model loads on first use, once, and every copy shares that
engine — and therefore its packed passes.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kev_engine import Engine

_lock = threading.Lock()
_engines: dict[tuple[str | None, str | None, str | None], Engine] = {}
_settings: dict[tuple[str | None, str | None, str | None], dict[str, Any]] = {}


def shared_engine(
    source: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    adapters: Mapping[str, str] | None = None,
    **engine_kwargs: Any,
) -> Engine:
    """The engine for (source, device, dtype), loading it on first use; adapters are loaded once.

    `engine_kwargs` (`max_batch_tokens`, `coalesce_ms`, ...) configure the engine when this call
    creates it; asking for different ones later is an error, not silently ignored.
    """
    key = (source, device, dtype)
    with _lock:  # one load even when many threads ask at once
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = Engine.from_pretrained(source, device=device, dtype=dtype, **engine_kwargs)
            _settings[key] = dict(engine_kwargs)
        elif engine_kwargs and engine_kwargs != _settings[key]:
            raise ValueError(
                f"the shared engine for {key} was created with {_settings[key]}; it cannot change to {engine_kwargs}"
            )
        for name, path in (adapters or {}).items():
            if name not in engine.adapters:
                engine.load_adapter(name, path)
    return engine


def resolve_engine(
    engine: Engine | None,
    source: str | None,
    device: str | None,
    dtype: str | None,
    adapters: Mapping[str, str],
) -> Engine:
    """The engine an integration object runs on: the one it was given (its adapters loaded into
    it once), else the shared one for (source, device, dtype)."""
    if engine is None:
        return shared_engine(source, device, dtype, adapters)
    for name, path in adapters.items():
        if name not in engine.adapters:
            engine.load_adapter(name, path)
    return engine


def clear_shared_engines() -> None:
    """Close and forget every shared engine (tests, or freeing memory)."""
    with _lock:
        for engine in _engines.values():
            engine.close()
        _engines.clear()
        _settings.clear()
