"""Arrivals: when an idle engine's first pass may start, so that callers who arrive together share it.

Where this sits: the worker asks `start_at()` before the first pass after idle. Concurrent callers
reach the engine spread out — threads a few milliseconds apart, `asyncio.gather`'s tasks one after
another on the event loop, each tokenizing its prompt first — and a pass that starts with the
first of them leaves the rest to a second pass. Three things decide the start:

- **Callers on their way.** A caller inside `submit` (tokenizing, compiling its constraint) is
  announced (`announce`): the pass waits for it. An async caller's announcement lasts until its
  event loop's next turn, so every task that submits in the same turn (a `gather`) is one group.
  A caller may announce itself earlier (`Engine.arriving()`: the server does, as a request's
  headers arrive). Every announcement expires after `ANNOUNCED_MAX_S`, so a caller that never
  ends its own cannot hold the engine.
- **A quiet window.** The pass starts once nobody arrived for `window_s`: a lone request waits
  exactly that (the engine's `coalesce_ms`), a burst waits until its last member.
- **Adaptation.** A request arriving during the first pass of a burst, within `MAX_WINDOW_FACTOR`
  windows of the last one admitted, missed that pass: the window grows to cover such a gap next
  time. Bursts without a straggler shrink it back towards `coalesce_ms`, so lone requests keep
  their latency.
`hold()` coalesces without any clock; this is for callers that cannot say a burst is coming.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

ANNOUNCED_MAX_S = 0.25  # the longest one announced caller may hold an idle engine's first pass
MAX_WINDOW_FACTOR = 8.0  # the quiet window grows to at most this many `coalesce_ms`
GROWTH = 1.5  # a straggler's gap times this becomes the window (margin over the gap seen)
DECAY = 0.8  # a burst without stragglers shrinks the window by this factor, down to the base


class Arrivals:
    """Announced callers, the last arrival, and the adaptive quiet window (used under the engine's lock)."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s = window_s
        self.window_s = window_s
        self.max_window_s = window_s * MAX_WINDOW_FACTOR
        self._clock = clock
        self._announced: dict[int, float] = {}  # id -> when it expires
        self._ids = itertools.count()
        self.last = -math.inf  # when the last caller arrived or was announced
        self._first_pass_after: float | None = None  # while a burst's first pass runs: its last arrival
        self._straggled = False

    def announce(self) -> int:
        """A caller is on its way: an idle engine's first pass waits for it (bounded)."""
        now = self._clock()
        token = next(self._ids)
        self._announced[token] = now + ANNOUNCED_MAX_S
        self.last = max(self.last, now)
        return token

    def end(self, token: int) -> None:
        """The caller has queued its requests (or given up); idempotent."""
        self._announced.pop(token, None)

    def arrived(self) -> None:
        """Requests were queued now: the quiet window restarts, and a straggler of a burst's first
        pass widens it for the next burst."""
        now = self._clock()
        if self._first_pass_after is not None:
            gap = now - self._first_pass_after
            if gap <= self.max_window_s:
                self.window_s = min(self.max_window_s, max(self.window_s, gap * GROWTH))
                self._straggled = True
        self.last = now

    def start_at(self) -> float:
        """When the first pass may start (clock time): after the quiet window, once no announced
        caller is on its way — whichever is later, each bounded."""
        now = self._clock()
        for token, expires in list(self._announced.items()):
            if expires <= now:
                del self._announced[token]
        at = self.last + self.window_s
        if self._announced:
            at = max(at, min(max(self._announced.values()), now + ANNOUNCED_MAX_S))
        return at

    def now(self) -> float:
        return self._clock()

    def first_pass(self, running: bool) -> None:
        """Mark the first pass after idle as started (`running`) or ended; a burst without
        stragglers shrinks the window back towards the base."""
        if running:
            self._first_pass_after, self._straggled = self.last, False
            return
        if self._first_pass_after is not None and not self._straggled:
            self.window_s = max(self.base_s, self.window_s * DECAY)
        self._first_pass_after = None


class Arrival:
    """One announced caller (`Engine.arriving()`): `end()` once its requests are queued, or use it
    as a context manager. Ending twice is harmless."""

    def __init__(self, owner: Any, token: int) -> None:
        self._owner: Any = owner
        self._token = token

    def end(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._end_arrival(self._token)

    def __enter__(self) -> Arrival:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
