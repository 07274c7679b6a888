"""Retries for `RemoteEngine`: which failures of a request to `kev serve` are worth another try,
and how long to wait before it.

Only failures where the server did no work for the request, or asked to be asked again: a
connection that could not be made or was dropped before any answer (the server restarting),
429 (its queue is full) and 503 (still loading, or shutting down). Never another 4xx: the
request itself is wrong and would fail the same way again. Never once an answer has started:
its text may already have reached the caller's `on_text`.

The wait follows the OpenAI client's rule, since `max_retries` is copied from `ChatOpenAI`: the
server's ``Retry-After`` (or ``retry-after-ms``) when it asks for at most `MAX_RETRY_AFTER_S`,
else exponential backoff from `BASE_DELAY_S`, doubling up to `MAX_DELAY_S`, less up to a
quarter at random so that clients refused together do not come back together.
"""

from __future__ import annotations

import email.utils
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

RETRY_STATUSES = frozenset({429, 503})
# raised before any byte of an answer came back (httpx's send() returns once the headers are in)
RETRY_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
)
BASE_DELAY_S = 0.5
MAX_DELAY_S = 8.0
MAX_RETRY_AFTER_S = 60.0


def check_max_retries(value: Any) -> int:
    """`max_retries` as an int ≥ 0, or a ValueError naming the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_retries={value!r} is not allowed; use a whole number >= 0 (0: no retries)")
    return value


def retry_after(headers: Mapping[str, str], now: Callable[[], float] = time.time) -> float | None:
    """The seconds a 429/503 asks the client to wait (``retry-after-ms``, else ``Retry-After`` as
    seconds or an HTTP date), or None when it asks nothing readable."""
    try:
        return float(headers["retry-after-ms"]) / 1000
    except (KeyError, ValueError):
        pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return email.utils.parsedate_to_datetime(value).timestamp() - now()
    except (TypeError, ValueError):
        return None


def retry_delay(attempt: int, headers: Mapping[str, str] | None = None,
                jitter: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number `attempt + 1` (`headers`: the refusal's, if any)."""
    asked = retry_after(headers) if headers is not None else None
    if asked is not None and 0 <= asked <= MAX_RETRY_AFTER_S:
        return asked
    return min(BASE_DELAY_S * 2**attempt, MAX_DELAY_S) * (1 - 0.25 * jitter())
