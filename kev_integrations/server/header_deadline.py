"""A deadline for request headers and a cap on open connections: uvicorn's HTTP protocol, closing
connections whose headers dawdle and refusing those past `max_connections`.

Why: uvicorn has no header timeout. Its keep-alive timer stops at the first byte a client sends,
so a client that sends its headers a byte every few seconds (slow-loris) holds a connection for
as long as it likes, and a few hundred such clients hold the server. The app's own body deadline
(`limits.BodyLimit`) starts only once the headers are in. Here each connection must complete a
request's headers within `timeout_s` of opening, and again within `timeout_s` of each response;
otherwise it gets a 408 in OpenAI's error shape and is closed. A request being answered is never
cut: the deadline applies only while the connection waits for headers.

The cap: per-key and queue limits bound requests, not sockets; idle keep-alive connections from
many clients would still pile up. A connection past `max_connections` open at once gets a 503 in
OpenAI's error shape with `Retry-After` and is closed at once.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .errors import APIError


def _raw_response(error: APIError) -> bytes:
    """`error` as the bytes of a whole HTTP/1.1 response that closes its connection: written to the
    socket here, before (or without) any ASGI request."""
    body = json.dumps(error.body()).encode()
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}", "content-type: application/json",
            "connection: close", *(f"{k.lower()}: {v}" for k, v in (error.headers or {}).items()),
            f"content-length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def header_deadline_protocol(timeout_s: float, base: type[asyncio.Protocol] = AutoHTTPProtocol,
                             max_connections: int | None = None, retry_after_s: int = 1) -> type[Any]:
    """uvicorn's HTTP protocol class (httptools or h11, as uvicorn picks) with a header deadline
    and at most `max_connections` open connections (None: no cap), for ``uvicorn.Config(http=...)``."""
    response = _raw_response(APIError(
        408, f"the request headers did not arrive within {timeout_s:g} s (this server's header_timeout_s)",
        code="header_timeout"))
    full = _raw_response(APIError(
        503, f"this server has {max_connections} connections open, its max_connections; retry shortly",
        type="server_error", code="too_many_connections", headers={"Retry-After": str(retry_after_s)}))
    open_now = [0]  # this server's connections (one event loop: no lock)

    class HeaderDeadline(base):  # type: ignore[valid-type, misc]
        _deadline: asyncio.TimerHandle | None = None
        _counted = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if max_connections is not None and open_now[0] >= max_connections:
                transport.write(full)
                transport.close()
                return
            open_now[0] += 1
            self._counted = True
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            if self._counted:
                open_now[0] -= 1
                self._counted = False
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(timeout_s, self._expire, self.cycle)

        def _expire(self, waiting_after: Any) -> None:
            """No new request since the deadline was armed, and none being answered: close."""
            if self.cycle is not waiting_after or (waiting_after is not None and not waiting_after.response_complete):
                return
            if not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

    return HeaderDeadline
