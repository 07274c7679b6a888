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

**Agent rounds** are bursts too, spread by the engine itself: four agents' tool calls, asked in one
pass, finish a few decode steps apart, and each agent's next question (after its tool ran) would
start a pass of its own. A caller that knows it will come back (`Engine.expect_follow_up`: an
agent integration, for a reply that calls a tool) says so; while such a follow-up is expected
(its request still running, or answered less than `FOLLOW_UP_GRACE_S` ago and not yet followed
up), a follow-up that came (`submit(..., follow_up=True)`: it continues after a tool result) waits
for the others — decodes go on, idle engine or busy — so the round's follow-ups are admitted
together. None waits more than `FOLLOW_UP_WAIT_S`, and nobody else waits; each follow-up meets the
longest-answered expectation, and waits only for those said before it came.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable

ANNOUNCED_MAX_S = 0.25  # the longest one announced caller may hold an idle engine's first pass
MAX_WINDOW_FACTOR = 8.0  # the quiet window grows to at most this many `coalesce_ms`
GROWTH = 1.5  # a straggler's gap times this becomes the window (margin over the gap seen)
DECAY = 0.8  # a burst without stragglers shrinks the window by this factor, down to the base
FOLLOW_UP_GRACE_S = 0.5  # after an answer whose caller said it comes back: how long it is waited for
FOLLOW_UP_WAIT_S = 1.0  # the longest a follow-up waits for its round's others to join it


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
        self._expected: dict[int, float] = {}  # follow-ups: id -> when it stops being waited for (inf: unanswered)
        self._queued: dict[int, Callable[[], bool]] = {}  # follow-ups: id -> whether its request still waits
        self._since: dict[int, float] = {}  # follow-ups: id -> when it was said

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

    def arrived(self, follow_up: bool = False) -> bool:
        """Requests were queued now: the quiet window restarts, and a straggler of a burst's first
        pass widens it for the next burst. A `follow_up` meets the longest-answered expectation;
        True if there was one (the requests may then wait for their round's others)."""
        now = self._clock()
        answered = [t for t, until in self._expected.items() if now < until < math.inf] if follow_up else []
        if answered:
            self.unexpect(min(answered, key=self._expected.__getitem__))
        if self._first_pass_after is not None:
            gap = now - self._first_pass_after
            if gap <= self.max_window_s:
                self.window_s = min(self.max_window_s, max(self.window_s, gap * GROWTH))
                self._straggled = True
        self.last = now
        return bool(answered)

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

    def expect(self, queued: Callable[[], bool]) -> int:
        """A follow-up is expected from the caller of a request now queued (`answered` once it is).
        `queued()` says whether that request still waits: until admitted it holds nobody back (a
        round's stragglers are never held for each other)."""
        token = next(self._ids)
        self._expected[token] = math.inf
        self._queued[token] = queued
        self._since[token] = self._clock()
        return token

    def answered(self, token: int) -> None:
        """The request was answered: its follow-up is waited for `FOLLOW_UP_GRACE_S` more."""
        if token in self._expected:
            self._expected[token] = self._clock() + FOLLOW_UP_GRACE_S

    def unexpect(self, token: int) -> None:
        """No follow-up will come (the answer called no tool, the caller gave up); idempotent."""
        self._expected.pop(token, None)
        self._queued.pop(token, None)
        self._since.pop(token, None)

    def defers(self, queued_at: float) -> bool:
        """Whether a follow-up queued at `queued_at` waits for its round's others: said before it
        came, and still running or answered and on their way back (the scheduler asks only for
        follow-ups). Expectations said after it are a later round's, never waited for."""
        now = self._clock()
        for token, until in list(self._expected.items()):
            if until <= now:
                self.unexpect(token)
        if now - queued_at >= FOLLOW_UP_WAIT_S:
            return False
        return any(self._since[token] <= queued_at and (until < math.inf or not self._queued[token]())
                   for token, until in self._expected.items())

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
    """One announced caller (`Engine.arriving()`) or expected follow-up (`Engine.expect_follow_up`):
    `end()` once its requests are queued (or none will come), or use it as a context manager.
    Ending twice is harmless."""

    def __init__(self, token: int, ending: Callable[[int], None]) -> None:
        self._ending: Callable[[int], None] | None = ending  # called once with the token
        self._token = token

    def end(self) -> None:
        ending, self._ending = self._ending, None
        if ending is not None:
            ending(self._token)

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
