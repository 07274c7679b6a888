"""A cap on request body size, enforced while the body arrives (pure ASGI middleware).

A declared Content-Length over the cap is refused before reading anything; a chunked body is
counted as it streams in and refused the moment it passes the cap, so no client can make the
server buffer an unbounded body.
"""

from __future__ import annotations

from typing import Any

from .errors import APIError

Scope = dict[str, Any]
Message = dict[str, Any]


class _TooLarge(Exception):
    pass


def body_too_large(max_bytes: int) -> APIError:
    """The 413 of a body over the cap (here, and at the Ray ingress, which reads bodies itself)."""
    return APIError(413, f"the request body is over this server's limit of {max_bytes} bytes", code="body_too_large")


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> APIError:
        return body_too_large(self.max_bytes)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._error().response()(scope, receive, send)
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._error().response()(scope, receive, send)
