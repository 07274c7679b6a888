"""A limit on the requests one API key has in flight (pure ASGI middleware).

Why: however many connections a server takes, one tenant should not be able to hold them all —
slow bodies, long streams, requests left waiting. A request counts from the moment its headers
are in until its response is complete (streams included); past `limit` the key's next request
gets a 429 at once, before its body is read. `/health` is never counted or refused. A request
without a valid key is not counted: it is answered 401 before its body is read.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .errors import APIError
from .tenants import Tenants

Scope = dict[str, Any]


class PerKeyLimit:
    def __init__(self, app: Any, tenants: Tenants, counts: Counter[str], limit: int, retry_after_s: int) -> None:
        self.app, self.tenants, self.counts, self.limit = app, tenants, counts, limit
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") == "/health":
            return await self.app(scope, receive, send)
        authorization = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        tenant = self.tenants.from_header(authorization)
        if tenant is None:
            return await self.app(scope, receive, send)
        # one event loop runs every request of this app: no lock between the check and the count
        if self.counts[tenant.id] >= self.limit:
            error = APIError(429, f"this API key has {self.counts[tenant.id]} requests in flight (this server's limit "
                             f"is {self.limit} per key, max_requests_per_key); retry when some finish",
                             type="rate_limit_error", code="too_many_requests_per_key",
                             headers={"Retry-After": str(self.retry_after_s)})
            return await error.response()(scope, receive, send)
        self.counts[tenant.id] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counts[tenant.id] -= 1
            if not self.counts[tenant.id]:
                del self.counts[tenant.id]
