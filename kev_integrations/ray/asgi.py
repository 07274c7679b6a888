"""Run one HTTP request through an ASGI app in-process and yield its response, piece by piece.

Why: a Ray replica serves the very app `kev serve` runs (auth, limits, constraints, tools,
streaming, Kev's own endpoints), without a port of its own. The ingress hands it the request
as plain data (`HTTPRequest`, which Ray pickles) and relays what comes back: first a
`ResponseStart` (status, headers), then the body as `bytes`, chunk by chunk, so server-sent
events flow through as they are produced.

Leaving early is a client disconnect: when the consumer stops (the ingress's client hung up,
or Ray cancelled the call), the app's `receive()` reports ``http.disconnect``, which makes it
cancel its engine requests exactly as under uvicorn; an app that does not return within
`DISCONNECT_GRACE_S` after that is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

DISCONNECT_GRACE_S = 5.0
# 2.3, not 2.4: under 2.4 Starlette's StreamingResponse stops only when `send` fails, and ours
# never does; under 2.3 it also listens for ``http.disconnect``, which `receive` reports.
SPEC_VERSION = "2.3"

Message = dict[str, Any]


@dataclass(frozen=True)
class HTTPRequest:
    """What the app needs of one request, as data that crosses processes."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": SPEC_VERSION}, "http_version": "1.1",
            "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
            "query_string": self.query, "root_path": "", "headers": list(self.headers),
            "client": self.client, "server": ("127.0.0.1", 80), "state": {},
        }


@dataclass(frozen=True)
class ResponseStart:
    """The first thing a response yields; `replica` names who answered (Ray replica id)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str = ""

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == wanted), None)


async def run_asgi(app: Any, request: HTTPRequest, replica: str = "") -> AsyncIterator[ResponseStart | bytes]:
    """Yield the app's `ResponseStart`, then its body chunks, until the response is complete."""
    sent: asyncio.Queue[Message] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()  # the app listens for a disconnect while it works
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if not gone.is_set():  # like a server whose client left: what is sent after that goes nowhere
            await sent.put(message)

    task = asyncio.create_task(app(request.scope(), receive, send), name=f"kev-asgi {request.path}")
    try:
        while True:
            message = await _next_message(sent, task)
            if message is None:  # the app returned without finishing a response
                raise RuntimeError(f"the app ended {request.method} {request.path} without a complete response")
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])],
                                    replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()  # a consumer that left early is a client that disconnected: the app cancels its work
        if not task.done():
            with contextlib.suppress(Exception, asyncio.CancelledError):  # its answer has no reader now
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
        if not task.done():
            task.cancel()


async def _next_message(sent: asyncio.Queue[Message], task: asyncio.Task[Any]) -> Message | None:
    """The app's next `send`, or None once the app has returned with nothing more to send.

    An exception the app raised propagates here (an app error is the caller's 500, not a hang).
    """
    if not sent.empty():
        return sent.get_nowait()
    getter = asyncio.ensure_future(sent.get())
    try:
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    task.result()  # raises what the app raised
    return sent.get_nowait() if not sent.empty() else None
