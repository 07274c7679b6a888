"""The admin endpoints (``--admin-key``): hot-load and unload LoRA adapters, set the default temperature."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kev_engine import Engine, InvalidRequestError, KevError

from .errors import APIError, bad_request

if TYPE_CHECKING:
    from .app import ServerState


def add_admin_routes(app: FastAPI, state: ServerState, check_key: Callable[[Request, tuple[str, ...], str], None],
                     json_body: Callable[[Request], Any]) -> None:
    config = state.config

    def admin(request: Request) -> Engine:
        if config.admin_key is None:
            raise APIError(403, "admin endpoints are disabled; start the server with --admin-key",
                           type="permission_error")
        check_key(request, (config.admin_key,), "admin endpoints")
        return state.ready()

    @app.post("/admin/adapters")
    async def load_adapter(request: Request) -> JSONResponse:
        engine = admin(request)
        body = await json_body(request)
        name, path = body.get("name"), body.get("path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise bad_request("give {'name': <adapter name>, 'path': <PEFT folder on the server>}")
        try:
            await asyncio.to_thread(engine.load_adapter, name, path)
        except (KevError, ValueError, OSError) as exc:
            raise bad_request(f"could not load adapter {name!r}: {exc}", param="path") from None
        return JSONResponse({"loaded": name, "adapters": engine.adapters})

    @app.delete("/admin/adapters/{name}")
    async def unload_adapter(name: str, request: Request) -> JSONResponse:
        engine = admin(request)
        try:
            engine.unload_adapter(name)
        except KevError as exc:
            raise APIError(404, str(exc), param="name") from None
        return JSONResponse({"unloaded": name, "adapters": engine.adapters})

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
