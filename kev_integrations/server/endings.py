"""Every way a request can end gets a well-formed answer (pure ASGI middleware, outermost).

Two endings escape FastAPI's handlers, and both used to reach the client as plain text or as a
cut connection, which OpenAI clients read as a bare failure (and retry blindly):

- `--grace` runs out at shutdown: uvicorn cancels the request's task. `CancelledError` is no
  `Exception`, so no handler sees it and uvicorn answers a plain-text 500.
- An unexpected exception in a route: Starlette answers a plain-text 500, or cuts a stream.

While the server drains at shutdown (`drain`), a new request gets that 503 at once (but /health,
which says "shutting_down"): the socket stays open so clients and load balancers get an answer
they retry elsewhere, not a refused connection.

Here a request that has not started its response gets a JSON error in OpenAI's shape — 503 with
``Retry-After`` when shutting down, else 500 — and a started event stream gets one SSE error
event and ``data: [DONE]``, so a client sees an error, never a stream that merely stops. Any
other response already under way is left as it is: nothing well-formed can follow half a body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import APIError
from .responses import sse

SHUTDOWN_RETRY_AFTER_S = 5  # a restart (or the next replica) is seconds away, not milliseconds

Scope = dict[str, Any]
Message = dict[str, Any]


def shutting_down() -> APIError:
    """The answer of a request cut by the end of the shutdown's grace period."""
    return APIError(503, "the server is shutting down and this request did not finish within its grace period "
                    "(--grace); it was cancelled, retry it", type="server_error", code="shutting_down",
                    headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})


def not_taken() -> APIError:
    """The answer of a request that arrives while the server drains."""
    return APIError(503, "the server is shutting down and takes no new requests; retry it (another server or "
                    "replica, or this one once restarted)", type="server_error", code="shutting_down",
                    headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})


@dataclass
class _Progress:
    """How far the app got with its response."""

    started: bool = False
    event_stream: bool = False
    finished: bool = False


class Endings:
    def __init__(self, app: Any, draining: Callable[[], bool] = lambda: False) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.draining() and scope.get("path") != "/health":
            return await not_taken().response()(scope, receive, send)
        progress = _Progress()

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                progress.started = True
                progress.event_stream = any(key.lower() == b"content-type" and value.startswith(b"text/event-stream")
                                            for key, value in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                progress.finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            # a client that leaves is a disconnect, not a cancel: a request's own task is cancelled by
            # uvicorn once --grace is over (it logs how many). Answer, then end the task normally: it
            # was cancelled to be stopped, and re-raising would only add a traceback per request.
            await _answer(progress, scope, receive, send, shutting_down())
        except Exception as exc:
            error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
            await _answer(progress, scope, receive, send, error)
            raise  # still logged by uvicorn, with its traceback


async def _answer(progress: _Progress, scope: Scope, receive: Any, send: Any, error: APIError) -> None:
    if progress.finished:
        return
    if not progress.started:
        await error.response()(scope, receive, send)
    elif progress.event_stream:
        await send({"type": "http.response.body", "body": (sse(error.body()) + sse("[DONE]")).encode(),
                    "more_body": False})
