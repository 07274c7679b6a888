"""Torch work that must not leave an OpenMP team on the caller's thread: run it on a thread that ends.

Where it sits: `Engine.from_pretrained` and `load_adapter` run their loading here; every pass
then runs on the engine's scheduler thread.

Why: libgomp (torch's OpenMP on Linux) gives each thread that runs a parallel op its own team
of worker threads and keeps that team until the thread exits. Once the teams together hold
more threads than there are cores, libgomp stops spinning between parallel regions, so every
later region wakes its workers through the kernel. A decode pass runs hundreds of regions, so a
model loaded on the caller's thread, whose team then lives on beside the scheduler thread's, made
every decode step measurably slower (docs/benchmarks.md, "Loading on a thread that ends"). A
thread that ends takes its team with it (torch's
bundled libgomp has no `omp_pause_resource`, and a one-thread region does not shrink a pool).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from ..platforms import carry_thread_state

T = TypeVar("T")


def run_on_passing_thread(fn: Callable[[], T], name: str) -> T:
    """`fn()` on a new thread that ends when it returns; its result or its exception, here.

    The caller's thread state that torch keeps per thread (`platforms.carry_thread_state`: the
    CUDA device) goes with it, so `device=None` resolves as it would have on the caller's thread.
    """
    enter = carry_thread_state()
    box: dict[str, T] = {}
    errors: list[BaseException] = []

    def body() -> None:
        try:
            enter()
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller, whatever it is
            errors.append(exc)

    # daemon: a caller interrupted while waiting (Ctrl-C during a load) does not keep the process alive
    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box["result"]
