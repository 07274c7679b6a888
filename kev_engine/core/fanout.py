"""n samples of one prompt: one prefill, then n decode rows reading the same prompt blocks.

Where this sits: `Scheduler.submit` turns a request with ``n`` > 1 into n requests — its samples —
and queues only the first; the others wait on it (`Request.siblings`). When the first samples
its first token, the prompt's KV is complete: the scheduler forks the others from it
(`Scheduler.fork`, `BlockManager.fork` shares the full prompt blocks and gives each a copy of a partly filled
last block, `KVPool.copy_blocks` copies that block's KV) and every sample draws its first token from
the same logits row, with its own generator. From then on they are ordinary running requests.
A sample that cannot be forked for now (no free block or sequence slot) is queued as a request
of its own instead: it computes what the prefix cache does not hold, and answers the same.

The caller sees one future (`futures`, `gather`), resolved with the first sample's `Completion` holding
all n in `samples`; cancelling it cancels every sample, and one failing fails the set.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from ..inputs.params import SEED_MAX, SamplingParams
from ..results import Completion
from .delivery import failed_future, resolve_future
from .request import Request


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index`: sample 0 keeps the request's seed (n=1 and n=4 agree on it),
    the others a 64-bit hash of (seed, index) — fixed by the request alone, so the whole set is
    reproducible whatever else is packed. Unseeded stays unseeded."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"kev-sample:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (SEED_MAX + 1)


def sample_settings(sampling: SamplingParams) -> list[SamplingParams]:
    """The settings of each of `sampling.n` samples: n=1 each, seeds from `sample_seed`."""
    return [replace(sampling, n=1, seed=sample_seed(sampling.seed, i)) for i in range(sampling.n)]


def gather(futures: Sequence[Future[Any]]) -> Future[Completion]:
    """One future for a prompt's samples: the first's Completion with all n in `samples`, or the
    first error (the other samples are then cancelled). Cancelling it cancels every sample."""
    outer: Future[Completion] = Future()
    lock = threading.Lock()  # samples resolve on delivery threads, cancellations on any thread
    left = [len(futures)]

    def on_done(done: Future[Any]) -> None:
        with lock:
            if outer.done():
                return
            left[0] -= 1
            finished = left[0] == 0
        if done.cancelled() or done.exception() is not None:
            for other in futures:
                other.cancel()
            if done.cancelled():
                outer.cancel()
            else:
                resolve_future(outer, exc=done.exception())
        elif finished:
            results = [f.result() for f in futures]
            resolve_future(outer, replace(results[0], samples=tuple(results)))

    def on_outer_done(done: Future[Completion]) -> None:
        if done.cancelled():
            for future in futures:
                future.cancel()

    outer.add_done_callback(on_outer_done)
    for future in futures:
        future.add_done_callback(on_done)
    return outer


def futures(submitted: Sequence[Request | BaseException]) -> list[Future[Any]]:
    """What each submitted prompt's caller waits on (`Scheduler.submit`): a refused one's error,
    its request's future, or its n samples' futures gathered into one."""
    return [failed_future(item) if isinstance(item, BaseException)
            else gather([item.future, *(s.future for s in item.siblings)]) if item.siblings else item.future
            for item in submitted]
