"""A small thread pool of the server's own, with a bound on the work waiting for it.

Why: work that takes CPU for a while (tokenizing a large text) must not run on the event loop,
where it would freeze `/health` and every other request, nor in the default thread pool, which
every request's submission shares — so each kind gets a few threads of its own, and a caller
past `max_pending` gets a 429 at once rather than a place in a queue without end. The
tokenizer releases the GIL while it works, so other requests run meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .errors import APIError

T = TypeVar("T")


class Workers:
    """`num_workers` threads; at most `max_pending` calls running or waiting for them."""

    def __init__(self, what: str, num_workers: int, max_pending: int, retry_after_s: int = 1) -> None:
        self.what, self.max_pending, self.retry_after_s = what, max_pending, retry_after_s
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix=f"kev-{what}")
        self._lock = threading.Lock()
        self.pending = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on one of the threads; a 429 naming the limit when `max_pending` are in."""
        with self._lock:
            if self.pending >= self.max_pending:
                raise APIError(429, f"{self.pending} {self.what} requests are running or waiting (this server's "
                               f"limit is {self.max_pending}); retry shortly", type="rate_limit_error",
                               code=f"{self.what}_busy", headers={"Retry-After": str(self.retry_after_s)})
            self.pending += 1
        future = self._pool.submit(fn, *args)
        future.add_done_callback(self._release)  # also when the caller left and the call was cancelled
        return await asyncio.wrap_future(future)

    def _release(self, _: Any) -> None:
        with self._lock:
            self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
