"""The worker: the one thread that runs an engine's passes, and what callers may do around it.

Where this sits: `Engine` starts it with the first request. It runs `step()` while there is
work, so callers of `submit()` on other threads (LangChain's thread pools, LlamaIndex's
`asyncio.gather`, a server's requests) coalesce into the same passes: an idle worker starts its
first pass when `arrivals` says the callers arriving together are in, and `hold()` coalesces
without a clock. Waiting questions join running ones between decode steps (continuous
batching). A pass that raises fails its requests, never the thread.

It drives a `Stepper` (`kev_engine/stepper.py`: has work, step, emptied, fail a pass, drain), held only
weakly between passes, so an engine dropped without `close()` is collected with its stepper (the
finalizer wakes the thread, which then ends). `stop()` ends it: the thread drains what is left
and returns. It never calls into the `Engine`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..errors import InvalidRequestError
from .arrivals import Arrivals

IDLE_RECHECK_S = 0.05  # a pass that could schedule nothing waits this long (or for news) before retrying


class Stepped(Protocol):
    """What the worker drives (`Stepper`). `has_work`, `emptied` and `drain` are called under the engine's lock."""

    def step(self) -> int: ...
    def has_work(self) -> bool: ...
    def emptied(self) -> bool: ...
    def drain(self) -> None: ...
    def fail_pass(self, exc: BaseException) -> None: ...


class Worker:
    """The scheduler thread of one engine, with `hold()` and the pass lock."""

    def __init__(self, owner: Stepped, cond: threading.Condition, arrivals: Arrivals,
                 enter: Callable[[], None] = lambda: None) -> None:
        """`enter()`: run first on the thread (the platform's setup of a pass thread)."""
        self.enter = enter
        self.cond = cond  # the engine's lock: every state change notifies it
        self.arrivals = arrivals  # under `cond`
        self.thread: threading.Thread | None = None
        self.stopping = False  # set by `stop()`: the thread drains what is left and ends
        self.stopped = False  # the thread ended after `stop()` (or never started)
        self.idle = threading.Event()  # set while the thread waits with nothing to do
        self.holds = 0  # > 0 while inside hold(): no new pass starts
        self.step_lock = threading.Lock()  # one pass at a time, whoever runs it
        self._stepping = threading.local()  # .active while this thread runs a pass: a model hook runs in one
        self._owner = weakref.ref(owner)

    def start(self) -> None:
        """Start the thread, once (call under `cond`)."""
        if self.thread is None:
            self.thread = threading.Thread(target=_loop, args=(self._owner, self), name="kev-scheduler", daemon=True)
            owner = self._owner()
            if owner is not None:
                weakref.finalize(owner, _notify, self.cond)
            self.thread.start()

    def run_pass(self, step: Any) -> int:
        """`step()` under the pass lock, marked as inside a pass for `refuse_blocking`."""
        with self.step_lock:
            self._stepping.active = True
            try:
                return int(step())
            finally:
                self._stepping.active = False

    def refuse_blocking(self, what: str, delivery: Any) -> None:
        """A blocking call from inside a pass (a model hook) waits for the pass it blocks. From a
        delivery thread (an on_text or future callback) it holds a thread that answers need: once
        every delivery thread waits like that, its own answer can never be delivered."""
        on_worker = self.thread is not None and threading.current_thread() is self.thread
        if on_worker or getattr(self._stepping, "active", False) or delivery.owns_current_thread():
            raise InvalidRequestError(
                f"Engine.{what}() was called from an engine callback (on_text or a future's done callback) or "
                "inside a pass; it would wait on the engine from the engine's own threads, possibly forever. "
                "Use submit() there, or hand the work to another thread"
            )

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self.cond:
            self.holds += 1
        try:
            yield
        finally:
            with self.cond:
                self.holds -= 1
                self.cond.notify_all()

    def stop(self) -> None:
        """End the thread once its pass is over; queued and running requests are drained (call
        under `cond`)."""
        self.stopping = True
        self.cond.notify_all()

    def join(self, timeout: float | None) -> bool:
        """After `stop()`: wait for the thread to end; False if it is still in a pass."""
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                return False
        return True


def _loop(owner_ref: weakref.ref[Stepped], worker: Worker) -> None:
    """The thread: wait for work (holding the engine only weakly), coalesce, pass, repeat."""
    worker.enter()
    cond = worker.cond
    arrivals = worker.arrivals
    was_idle = True
    while True:
        with cond:
            while True:
                owner = owner_ref()
                if owner is None:
                    return
                if worker.stopping:
                    break
                if not worker.holds and owner.has_work():
                    # the first pass after idle waits for the callers arriving together (`arrivals`;
                    # a window of 0: at once)
                    wait_s = arrivals.start_at() - arrivals.now() if was_idle and arrivals.base_s else 0.0
                    if wait_s <= 0:
                        break
                    del owner
                    cond.wait(wait_s)
                    continue
                was_idle = True
                del owner  # never wait holding it
                worker.idle.set()
                cond.wait()
                worker.idle.clear()
            if worker.stopping:
                owner.drain()
                return
            first = was_idle
            if first:
                arrivals.first_pass(running=True)
        was_idle = False
        try:
            ran = worker.run_pass(owner.step)
        except BaseException as exc:  # noqa: BLE001 - a failed pass fails its requests, not the loop
            owner.fail_pass(exc)
            ran = 1
        with cond:
            if first:
                arrivals.first_pass(running=False)
            was_idle = owner.emptied()  # its callers may have come back before this thread looked
            if not ran:  # nothing could run (e.g. waiting on adapter slots): wait for news, bounded
                cond.wait(IDLE_RECHECK_S)
        del owner


def _notify(cond: threading.Condition) -> None:
    with cond:
        cond.notify_all()
