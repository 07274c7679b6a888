"""One engine per (source, device, dtype), shared by every LLM object that names it.

LangChain and LlamaIndex copy LLM objects freely (`bind`, `configurable_fields`, `model_copy`),
so construction must be cheap: the model loads on first use, once, and every copy shares that
engine — and therefore its packed passes. Spellings of the same engine share one key:
``device=None`` is the device it resolves to, ``dtype="fp32"`` is ``"float32"``, and a local
folder is its absolute path.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kev_engine import AdapterError, Engine, EngineLike, resolve_device, resolve_dtype

from .remote import RemoteEngine

EngineKey = tuple[str | None, str, str]

_lock = threading.Lock()
_adapter_lock = threading.Lock()
_engines: dict[EngineKey, Engine] = {}
_settings: dict[EngineKey, dict[str, Any]] = {}
_remotes: dict[tuple[str, str | None, int], RemoteEngine] = {}


def engine_key(source: str | None, device: str | None, dtype: str | None) -> EngineKey:
    """The canonical (source, device, dtype) of an engine; a bad device or dtype raises here."""
    resolved = resolve_device(device, indexed=True)  # "cuda" and "cuda:0" are one device
    dtype_name = str(resolve_dtype(dtype, resolved)).removeprefix("torch.")
    if source is not None and Path(source).expanduser().exists():  # a local folder or .gguf, not a hub id
        source = str(Path(source).expanduser().resolve())
    return source, str(resolved), dtype_name


def load_adapters(engine: EngineLike, adapters: Mapping[str, str]) -> None:
    """Load each adapter into `engine`: a no-op for a name already loaded from the same folder,
    an error for a name already loaded from another one (objects sharing an engine share its
    adapter names, so one name can never quietly mean two adapters)."""
    with _adapter_lock:  # two objects declaring the same new adapter at once: it loads once
        for name, path in adapters.items():
            try:
                engine.load_adapter(name, path)
            except AdapterError as exc:
                raise AdapterError(
                    f"adapters={{{name!r}: {path!r}}} conflicts with the engine {engine.name!r} this object "
                    f"shares: {exc}"
                ) from exc


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
    key = engine_key(source, device, dtype)
    with _lock:  # one load even when many threads ask at once
        engine = _engines.get(key)
        if engine is None:
            engine = Engine.from_pretrained(key[0], device=key[1], dtype=key[2], **engine_kwargs)
            _engines[key] = engine
            _settings[key] = dict(engine_kwargs)
        elif engine_kwargs and engine_kwargs != _settings[key]:
            raise ValueError(
                f"the shared engine for {key} was created with {_settings[key]}; it cannot change to {engine_kwargs}"
            )
    load_adapters(engine, adapters or {})
    return engine


def remote_engine(base_url: str, api_key: str | None, max_retries: int = 0) -> RemoteEngine:
    """One client per (server, key, retries), shared like local engines: copies of an LLM object share it."""
    key = (base_url.rstrip("/").removesuffix("/v1"), api_key, max_retries)
    with _lock:
        client = _remotes.get(key)
        if client is None:
            client = _remotes[key] = RemoteEngine(key[0], api_key, max_retries=max_retries)
    return client


def resolve_engine(
    engine: EngineLike | None,
    source: str | None,
    device: str | None,
    dtype: str | None,
    adapters: Mapping[str, str],
    base_url: str | None = None,
    api_key: str | None = None,
    max_retries: int = 0,
    speculative: str | None = None,
    draft_model: str | None = None,
) -> EngineLike:
    """The engine an integration object runs on: the one it was given (its adapters loaded into
    it), else a running `kev serve` at `base_url` (`max_retries`: see `RemoteEngine`), else the
    shared one for (source, device, dtype), built with `speculative` and `draft_model` where they
    are given."""
    if engine is not None and base_url is not None:
        raise ValueError("give engine= or base_url=, not both")
    if engine is not None and (speculative is not None or draft_model is not None):
        raise ValueError("speculative= and draft_model= configure an engine this object builds; the engine= given "
                         "has its own")
    if base_url is not None:
        if any(value is not None for value in (source, device, dtype, speculative, draft_model)):
            raise ValueError(f"model/device/dtype/speculative/draft_model are chosen by the server at {base_url}; "
                             "leave them unset")
        client = remote_engine(base_url, api_key, max_retries)
        for name, path in adapters.items():  # the server holds adapters: only check they are there
            client.load_adapter(name, path)
        return client
    if engine is None:
        settings = {"speculative": speculative, "draft_model": draft_model}
        return shared_engine(source, device, dtype, adapters, **{k: v for k, v in settings.items() if v is not None})
    load_adapters(engine, adapters)
    return engine


def clear_shared_engines() -> None:
    """Close and forget every shared engine (tests, or freeing memory)."""
    with _lock:
        for engine in _engines.values():
            engine.close()
        _engines.clear()
        _settings.clear()
        for client in _remotes.values():
            client.close()
        _remotes.clear()
