"""Grammar compiles of the server's requests: a pool of their own, a time budget, a per-key limit.

Why: a large allowed JSON schema compiles for seconds, and more than a minute at a few
thousand optional properties (docs/benchmarks.md). The engine compiles on the thread that submits; under a
server that would be the default pool every request's submission shares, so a few large
schemas would stall everyone. Instead, before submitting, the server compiles each constraint
not cached yet into the engine's grammar cache (`Engine.compile_grammar`) on `compile_workers`
threads of its own, so submitting then finds it cached:

- Concurrent requests for the same grammar (and cache salt) share one compile.
- One API key has at most `max_compiles_per_key` distinct grammars compiling or waiting, all
  keys together `max_pending_compiles`; past either a 429 names the limit.
- A compile no thread has taken up within `compile_timeout_s` is a 429 (the pool is busy); one
  that has run for `compile_timeout_s` without finishing is a 400 (`ConstraintError`).

Compile threads run at the lowest CPU priority (Linux: nice 19 is per thread), so they get the
CPU the engine's passes leave: on a busy server a large schema runs into its budget rather than
slowing everyone's answers. After each compile the C heap it freed goes back to the OS (glibc
would keep over a hundred MiB of it per large schema in RSS).

xgrammar cannot interrupt a compile. A request past its budget gets its answer at the deadline,
but the compile runs on to its end in the pool: until then it holds its thread and counts
against its key's limit (what keeps one key from filling the pool with compiles it gave up
on), and once done its grammar is cached, so the same request sent again then succeeds. A
compile that no thread has taken up is dropped when every request waiting for it has left.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kev_engine import ConstraintError, Engine, SamplingParams

from .config import ServerConfig
from .errors import APIError
from .tenants import Tenant

COMPILE_NICE = 19


def _lower_priority() -> None:
    """Each compile thread's start: the engine's passes come first."""
    if sys.platform.startswith("linux"):  # elsewhere setpriority is per process: it would slow the engine too
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)


def _malloc_trim() -> Any:
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc only
    return None


MALLOC_TRIM = _malloc_trim()


@dataclass
class _Job:
    """One grammar compiling (or waiting for a thread), shared by every request that needs it."""

    tenant: str
    started: Future[float] = field(default_factory=Future)  # set to time.monotonic() when a thread takes it
    done: Future[None] | None = None
    waiters: int = 0


class Compiles:
    """The server's grammar compiles, bounded in threads, time and per API key."""

    def __init__(self, config: ServerConfig) -> None:
        self.per_key, self.max_pending = config.max_compiles_per_key, config.max_pending_compiles
        self.timeout_s, self.retry_after_s = config.compile_timeout_s, config.retry_after_s
        self.workers = config.compile_workers
        self._pool = ThreadPoolExecutor(config.compile_workers, thread_name_prefix="kev-grammar",
                                        initializer=_lower_priority)
        self._lock = threading.RLock()  # RLock: a cancelled job's done-callback runs where it is cancelled
        self._jobs: dict[tuple[Any, ...], _Job] = {}
        self._by_tenant: Counter[str] = Counter()

    def in_flight(self) -> tuple[int, int]:
        """(distinct grammars compiling or waiting for a thread, requests waiting for them)."""
        with self._lock:
            return len(self._jobs), sum(job.waiters for job in self._jobs.values())

    async def ensure(self, engine: Engine, tenant: Tenant,
                     samplings: Sequence[SamplingParams | BaseException]) -> list[ConstraintError | None]:
        """Compile every constraint of `samplings` not cached yet; per sampling, its error or None.

        A bad constraint, or one over the time budget, is that sampling's `ConstraintError` (its
        request fails alone); a limit reached is an `APIError` 429 for the whole HTTP request.
        """
        errors: list[ConstraintError | None] = []
        for sampling in samplings:
            if isinstance(sampling, BaseException) or engine.has_grammar(sampling):
                errors.append(None)
                continue
            try:
                await self._compile(engine, tenant, sampling)
                errors.append(None)
            except ConstraintError as exc:
                errors.append(exc)
        return errors

    async def _compile(self, engine: Engine, tenant: Tenant, sampling: SamplingParams) -> None:
        assert sampling.constraint is not None  # has_grammar is True without one
        key = (sampling.cache_salt, *sampling.constraint)
        job = self._join(key, engine, tenant, sampling)
        try:
            waiting = asyncio.wrap_future(job.started)
            done, _ = await asyncio.wait({waiting}, timeout=self.timeout_s)  # asyncio.wait never cancels it
            if not done:
                raise APIError(429, f"grammar compiles are busy: no compile thread (this server has {self.workers}) "
                               f"took this {sampling.constraint[0]} up within {self.timeout_s:g} s; retry later",
                               type="rate_limit_error", code="compiles_busy",
                               headers={"Retry-After": str(self.retry_after_s)})
            assert job.done is not None
            compiling = asyncio.wrap_future(job.done)
            left = waiting.result() + self.timeout_s - time.monotonic()
            finished, _ = await asyncio.wait({compiling}, timeout=max(0.0, left))
            if not finished:
                raise ConstraintError(
                    f"the {sampling.constraint[0]} constraint did not compile within {self.timeout_s:g} s (this "
                    "server's compile time budget); simplify it. Its compile still finishes in the background, "
                    "after which the same request is answered", param=sampling.constraint[0])
            compiling.result()  # a bad constraint raises its ConstraintError here
        finally:
            self._leave(job)

    def _join(self, key: tuple[Any, ...], engine: Engine, tenant: Tenant, sampling: SamplingParams) -> _Job:
        """The job compiling `key`: the one running, or a new one if the limits allow it."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                if self._by_tenant[tenant.id] >= self.per_key:
                    raise APIError(429, f"this API key already has {self._by_tenant[tenant.id]} grammar(s) compiling "
                                   f"(limit {self.per_key} per key, max_compiles_per_key); retry once they finish",
                                   type="rate_limit_error", code="compiles_per_key",
                                   headers={"Retry-After": str(self.retry_after_s)})
                if len(self._jobs) >= self.max_pending:
                    raise APIError(429, f"{len(self._jobs)} grammars are compiling or waiting to (limit "
                                   f"{self.max_pending}, max_pending_compiles); retry later", type="rate_limit_error",
                                   code="compiles_busy", headers={"Retry-After": str(self.retry_after_s)})
                job = _Job(tenant.id)
                self._jobs[key] = job
                self._by_tenant[tenant.id] += 1
                job.done = self._pool.submit(self._run, job, engine, sampling)
                job.done.add_done_callback(lambda _: self._finished(key, job))
            job.waiters += 1
            return job

    @staticmethod
    def _run(job: _Job, engine: Engine, sampling: SamplingParams) -> None:
        job.started.set_result(time.monotonic())
        try:
            engine.compile_grammar(sampling)
        finally:
            if MALLOC_TRIM is not None:
                MALLOC_TRIM(0)

    def _leave(self, job: _Job) -> None:
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0 and not job.started.done() and job.done is not None:
                job.done.cancel()  # nobody waits for it and no thread has it: drop it (frees its slot)

    def _finished(self, key: tuple[Any, ...], job: _Job) -> None:
        """The compile ended (or was dropped before it started): its key's slot is free again."""
        with self._lock:
            if self._jobs.get(key) is job:
                del self._jobs[key]
            self._by_tenant[job.tenant] -= 1
            if not self._by_tenant[job.tenant]:
                del self._by_tenant[job.tenant]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
