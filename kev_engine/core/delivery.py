"""Delivery: each request's callbacks — its `on_text` pieces, then its result — run off the
scheduler thread, in order per request.

Where it sits: the engine's step produces text and results; instead of calling the caller's
code itself (one slow `on_text` would stall every request in the pack), it posts a job to the
request's `Mailbox`. A small pool of delivery threads drains the mailboxes: one mailbox is
drained by one thread at a time, in the order its jobs were posted, so a request's pieces
arrive in order and its future resolves after its last piece. A slow or blocked callback holds
only its own mailbox and one delivery thread; the others go on, and the scheduler never waits.

Memory when a consumer never keeps up: nothing stops the request — it runs, finishes and frees
its KV on schedule — and its mailbox keeps the pieces not yet delivered, at most one per token
it generated (so bounded by its `max_tokens`, the size of its own answer), then its result.
The engine applies no back-pressure: holding KV for a slow reader would cost every other
request. Threads are bounded too: at most `max_workers` run callbacks at once; if that many are
blocked, other mailboxes wait for a free thread (still bounded as above) and the scheduler
still runs. Idle threads end after `IDLE_S`, so an idle engine keeps none (nor any OpenMP team
a callback's torch work gave one; see `threads`).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

logger = logging.getLogger("kev")

MAX_WORKERS = 32  # callbacks running at once (each blocked callback holds one)
IDLE_S = 5.0  # an idle delivery thread ends after this long

_current = threading.local()  # .delivery: the Delivery whose thread this is


def hand_text(future: Future[Any], on_text: Callable[[str], None], piece: str) -> None:
    """A delivery job: one piece to a request's `on_text`. What the callback raises (even
    KeyboardInterrupt: the caller's callback, its error) fails that request alone, and no later
    piece is handed over."""
    if future.done():  # cancelled, or failed by an earlier piece
        return
    try:
        on_text(piece)
    except BaseException as exc:  # noqa: BLE001 - handed to the request, never raised on this thread
        try:
            future.set_exception(exc)
        except InvalidStateError:  # cancelled meanwhile: nobody waits for it
            pass


class Mailbox:
    """One request's jobs not yet run, in the order they were posted."""

    __slots__ = ("jobs", "queued")

    def __init__(self) -> None:
        self.jobs: collections.deque[Callable[[], None]] = collections.deque()
        self.queued = False  # in the ready queue or being run: never two threads on one mailbox


class Delivery:
    """A lazily grown pool of threads that runs each mailbox's jobs in order."""

    def __init__(self, name: str, max_workers: int = MAX_WORKERS) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers} must be at least 1")
        self.name = name
        self.max_workers = max_workers
        self._cond = threading.Condition()
        self._ready: collections.deque[Mailbox] = collections.deque()
        self._workers = 0
        self._idle = 0
        self._closing = False

    def post(self, mailbox: Mailbox, job: Callable[[], None]) -> None:
        """Run `job` after every job posted to `mailbox` before it, on a delivery thread."""
        with self._cond:
            mailbox.jobs.append(job)
            if mailbox.queued:
                return  # the thread that has it, or will take it, runs this job too
            mailbox.queued = True
            self._ready.append(mailbox)
            if len(self._ready) > self._idle and self._workers < self.max_workers:
                self._workers += 1
                threading.Thread(target=self._work, name=f"{self.name}-delivery", daemon=True).start()
            else:
                self._cond.notify()

    def post_text(self, mailbox: Mailbox, future: Future[Any], on_text: Callable[[str], None], piece: str) -> None:
        """Hand `piece` to `on_text` after what `mailbox` was posted before (`hand_text`)."""
        self.post(mailbox, functools.partial(hand_text, future, on_text, piece))

    def post_result(self, mailbox: Mailbox, future: Future[Any], result: Any = None,
                    exc: BaseException | None = None) -> None:
        """Resolve `future` with `result` or `exc` after every piece `mailbox` was posted before
        (its done callbacks then run on a delivery thread)."""
        self.post(mailbox, functools.partial(resolve_future, future, result, exc))

    def owns_current_thread(self) -> bool:
        """Whether the caller runs on one of this pool's threads (inside a callback)."""
        return getattr(_current, "delivery", None) is self

    def close(self) -> None:
        """Let threads end as soon as nothing is ready; jobs posted later still run (on a new thread)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def _work(self) -> None:
        _current.delivery = self
        while True:
            with self._cond:
                while not self._ready:
                    if self._closing:
                        self._workers -= 1
                        return
                    self._idle += 1
                    woken = self._cond.wait(IDLE_S)
                    self._idle -= 1
                    if not woken and not self._ready:
                        self._workers -= 1
                        return
                mailbox = self._ready.popleft()
                job = mailbox.jobs.popleft()
            try:
                job()
            except BaseException:  # noqa: BLE001 - a callback's error is its request's, never this thread's end
                logger.exception("a callback delivered by %s raised", self.name)
            with self._cond:
                if mailbox.jobs:
                    self._ready.append(mailbox)  # one job per turn: a long backlog never starves the others
                    self._cond.notify()  # an idle thread may take the next mailbox meanwhile
                else:
                    mailbox.queued = False


def failed_future(exc: BaseException) -> Future[Any]:
    """A refused request's answer: a future that already holds its error."""
    future: Future[Any] = Future()
    future.set_exception(exc)
    return future


def resolve_future(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Complete a request's future unless its caller cancelled it meanwhile.

    Futures stay PENDING while their request runs (never `set_running_or_notify_cancel`), so a
    caller — or asyncio, through `wrap_future` — can cancel a request at any time before it ends.
    """
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:  # cancelled between our check and now: nobody waits for it
        pass
