"""The admin endpoints (``--admin-key``): hot-load and unload LoRA adapters, set the default temperature.

An adapter unloaded while requests still use it is *draining* until they finish: listed as such,
a repeated DELETE says so (202), and loading its name again waits for it, bounded by
`ServerConfig.adapter_drain_wait_s`, then answers 409 saying why — never a 404 or a vague 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kev_engine import Engine, InvalidRequestError, KevError, check_adapter_name

from .errors import APIError, bad_request
from .state import ServerState


def adapter_states(engine: Engine) -> list[dict[str, Any]]:
    """Every adapter the engine holds: ``loaded`` (servable) or ``draining`` (with its requests left)."""
    draining = engine.draining_adapters
    return ([{"name": name, "state": "loaded"} for name in engine.adapters]
            + [{"name": name, "state": "draining", "requests": count} for name, count in draining.items()])


async def wait_drained(engine: Engine, name: str, timeout: float) -> None:
    """Return once `name` is not draining; 409 naming why if it still is after `timeout` s."""
    if name not in engine.draining_adapters:
        return
    if await asyncio.to_thread(engine.wait_for_unload, name, timeout):
        return
    requests = engine.draining_adapters.get(name, 0)
    raise APIError(409, f"adapter {name!r} is still draining: {requests} request(s) that started before its unload "
                   f"still use it (waited {timeout:g} s); load it again once GET /admin/adapters no longer lists it",
                   param="name", code="adapter_draining")


def add_admin_routes(app: FastAPI, state: ServerState, check_key: Callable[[Request, tuple[str, ...], str], object],
                     json_body: Callable[[Request], Any]) -> None:
    config = state.config

    def admin(request: Request) -> Engine:
        if config.admin_key is None:
            raise APIError(403, "admin endpoints are disabled; start the server with --admin-key",
                           type="permission_error")
        check_key(request, (config.admin_key,), "admin endpoints")
        return state.ready()

    @app.get("/admin/adapters")
    async def list_adapters(request: Request) -> JSONResponse:
        return JSONResponse({"adapters": adapter_states(admin(request))})

    @app.post("/admin/adapters")
    async def load_adapter(request: Request) -> JSONResponse:
        engine = admin(request)
        body = await json_body(request)
        name, path = body.get("name"), body.get("path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise bad_request("give {'name': <adapter name>, 'path': <PEFT folder on the server>}",
                              param="name" if not isinstance(name, str) else "path")
        try:  # before any work: a name /v1/models lists for the model itself, or one no URL can unload
            check_adapter_name(name, reserved=(state.model_name,))
        except KevError as exc:
            raise bad_request(str(exc), param="name") from None
        await wait_drained(engine, name, config.adapter_drain_wait_s)
        try:
            await asyncio.to_thread(engine.load_adapter, name, path)
        except (KevError, ValueError, OSError) as exc:
            raise bad_request(f"could not load adapter {name!r}: {exc}", param="path") from None
        return JSONResponse({"loaded": name, "adapters": engine.adapters})

    @app.delete("/admin/adapters/{name}")
    async def unload_adapter(name: str, request: Request) -> JSONResponse:
        engine = admin(request)
        try:
            engine.unload_adapter(name)  # a name already draining stays so: no error
        except KevError as exc:
            raise APIError(404, str(exc), param="name") from None
        requests = engine.draining_adapters.get(name)
        if requests is None:
            return JSONResponse({"name": name, "state": "unloaded", "adapters": engine.adapters})
        return JSONResponse(status_code=202, content={
            "name": name, "state": "draining", "requests": requests, "adapters": engine.adapters,
            "message": f"adapter {name!r} is draining: {requests} request(s) that started before the unload still "
                       "use it; it is gone when they finish (GET /admin/adapters lists it until then)"})

    @app.post("/admin/defaults")
    async def set_defaults(request: Request) -> JSONResponse:
        engine = admin(request)
        body = await json_body(request)
        if set(body) != {"temperature"}:
            raise bad_request("give {'temperature': <number >= 0>}; it is the only engine default", param="temperature")
        try:
            defaults = engine.set_defaults(temperature=body["temperature"])
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param="temperature") from None
        return JSONResponse({"temperature": defaults.temperature, "version": defaults.version})
