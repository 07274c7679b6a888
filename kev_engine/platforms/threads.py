"""The process's compute threads: how many (`use_threads`), and torch work that must not leave an
OpenMP team on the caller's thread (`run_on_passing_thread`).

Where it sits: `Engine.__init__` sets the thread count once (`threads=`, else `KEV_THREADS`);
`Engine.from_pretrained` and `load_adapter` run their loading on a passing thread; every pass
then runs on the engine's scheduler thread.

Threads: torch's intra-op count is the process's, and Kev's CPU kernels size their own pool by it
(csrc/pool.h, where a thread whose core another program takes computes less of each call instead
of holding every call up). The default is torch's: one thread per physical core Python may use.

A passing thread, why: libgomp (torch's OpenMP on Linux) gives each thread that runs a parallel op its own team
of worker threads and keeps that team until the thread exits. Once the teams together hold
more threads than there are cores, libgomp stops spinning between parallel regions, so every
later region wakes its workers through the kernel. A decode pass runs hundreds of regions, so a
model loaded on the caller's thread, whose team then lives on beside the scheduler thread's, made
every decode step measurably slower (docs/benchmarks.md, "Loading on a thread that ends"). A
thread that ends takes its team with it (torch's bundled libgomp has no `omp_pause_resource`, and
a one-thread region does not shrink a pool).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch

from . import carry_thread_state

T = TypeVar("T")
ENV_VAR = "KEV_THREADS"


def use_threads(threads: int | None) -> int:
    """Set the process's compute threads to `threads` (None: `KEV_THREADS`, else leave torch's
    default) and return the count in use. Process-wide: torch has one count for all its engines."""
    where = "threads"
    if threads is None and os.environ.get(ENV_VAR, "").strip():
        where, raw = ENV_VAR, os.environ[ENV_VAR].strip()
        threads = int(raw) if raw.isdigit() else raw  # type: ignore[assignment]
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"{where}={threads!r} is not allowed; give a whole number of threads, 1 or more "
                             f"(this machine lets Python use {len(os.sched_getaffinity(0))} cores)")
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
    return torch.get_num_threads()


def on_passing_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """`fn()` on a new thread that ends when it returns, as a future (cancelled before it starts:
    skipped). The caller's thread state that torch keeps per thread (`platforms.carry_thread_state`:
    the CUDA device) goes with it, so `device=None` resolves as it would have on the caller's thread."""
    future: Future[T] = Future()
    _start(fn, name, future)
    return future


def run_on_passing_thread(fn: Callable[[], T], name: str) -> T:
    """`fn()` on a new thread that ends when it returns (`on_passing_thread`); its result or its
    exception, here, once the thread has ended."""
    future: Future[T] = Future()
    _start(fn, name, future).join()
    return future.result()


def _start(fn: Callable[[], T], name: str, future: Future[T]) -> threading.Thread:
    enter = carry_thread_state()

    def body() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            enter()
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller, whatever it is
            future.set_exception(exc)

    # daemon: a caller interrupted while waiting (Ctrl-C during a load) does not keep the process alive
    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread
