"""A cap on request body size and on the time it takes to arrive (pure ASGI middleware).

A declared Content-Length over the cap is refused before reading anything; a chunked body is
counted as it streams in and refused the moment it passes the cap, so no client can make the
server buffer an unbounded body. A body not complete within `timeout_s` of its headers gets a
408 and its connection is closed, so a client sending a byte every few seconds cannot hold a
connection (and a place in its key's in-flight limit) for as long as it likes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .errors import APIError

Scope = dict[str, Any]
Message = dict[str, Any]


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


def body_too_large(max_bytes: int) -> APIError:
    """The 413 of a body over the cap (here, and at the Ray ingress, which reads bodies itself)."""
    return APIError(413, f"the request body is over this server's limit of {max_bytes} bytes", code="body_too_large")


def body_too_slow(timeout_s: float) -> APIError:
    """The 408 of a body that did not arrive in time; the connection closes after it."""
    return APIError(408, f"the request body did not arrive within {timeout_s:g} s of its headers (this server's "
                    "body_timeout_s); send it faster", code="body_timeout", headers={"Connection": "close"})


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await body_too_large(self.max_bytes).response()(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        seen, complete = 0, False

        async def counted() -> Message:
            nonlocal seen, complete
            if complete:  # the body is in: what follows is waiting for a disconnect, which has no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise _TooSlow from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
                complete = not message.get("more_body", False)
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await body_too_large(self.max_bytes).response()(scope, receive, send)
        except _TooSlow:
            await body_too_slow(self.timeout_s).response()(scope, receive, send)
