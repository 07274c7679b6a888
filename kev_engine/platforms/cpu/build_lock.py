"""One process at a time in a kernel build folder (`kernels` holds it while it builds or loads a build).

The lock is an flock on `.kev-build.lock` in the folder, so the kernel releases it when its holder
dies and a killed build never blocks the next one. The holder writes into that file who it is
(pid, Python environment) and what it is doing, so a process that has to wait says whose build it
waits for and why, instead of waiting without a word.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

log = logging.getLogger("kev")

FILE = ".kev-build.lock"
POLL_S = 0.5
# why a waiter waits: the folder's name holds everything the build's command lines hold
WHY = ("a folder is built by one process at a time, and its name covers the sources, flags, torch, CPU, "
       "compiler and include paths, so that build is the one this process needs; it loads it when the other is done")


def _try_lock(handle: IO[str]) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(handle: IO[str]) -> str:
    """Who holds the lock, as the holder wrote it (empty until it has)."""
    handle.seek(0)
    return handle.read().strip() or "a process that has not yet said who it is"


def _wait(handle: IO[str], folder: Path, name: str, say_every_s: float) -> None:
    log.warning("waiting for another process's build of Kev's CPU kernels (%s) in %s: %s. Why: %s",
                name, folder, _holder(handle), WHY)
    said = time.monotonic()
    while not _try_lock(handle):
        time.sleep(POLL_S)
        if time.monotonic() - said > say_every_s:
            log.warning("still waiting for the build of Kev's CPU kernels (%s) in %s: %s",
                        name, folder, _holder(handle))
            said = time.monotonic()


@contextlib.contextmanager
def hold(folder: Path, name: str, say_every_s: float) -> Iterator[Callable[[str], None]]:
    """Hold `folder`'s lock, first waiting (and saying for whom, every `say_every_s`) while another
    process holds it. Yields `note(doing)`, which tells later waiters what this process is doing."""
    # opened without truncating: a waiter must not erase the holder's words
    with os.fdopen(os.open(folder / FILE, os.O_RDWR | os.O_CREAT, 0o644), "r+") as handle:
        if not _try_lock(handle):
            _wait(handle, folder, name, say_every_s)

        def note(doing: str) -> None:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()} of the Python environment {sys.prefix}, "
                         f"{doing} since {time.strftime('%H:%M:%S')}")
            handle.flush()

        note("checking its build")
        try:
            yield note
        finally:
            handle.seek(0)
            handle.truncate()
            handle.flush()
            fcntl.flock(handle, fcntl.LOCK_UN)
