"""Schedule: which tokens of which questions run in the next pass, under a token budget.

Running questions go first (a decode is one token; a long prompt continues in chunks), so
no admitted question ever starves. Then waiting questions join in arrival-group order,
shortest bucket first inside a group (sorted, bucketed in `BUCKET`-token steps), while the
token budget and the sequence slots last. Finished questions leave: nothing is computed for
them again (continuous batching).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .request import Request

BUCKET = 128


def bucket_of(num_tokens: int) -> int:
    """Length bucket: prompts within the same `BUCKET`-token step count as equally long."""
    return (num_tokens + BUCKET - 1) // BUCKET


@dataclass
class Chunk:
    """`num_tokens` of `request` starting at `request.num_computed`, run this pass."""

    request: Request
    num_tokens: int

    @property
    def completes_known_tokens(self) -> bool:
        """True when this chunk reaches the request's last known token: sample after it."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, max_batch_tokens: int, max_num_seqs: int) -> None:
        if max_batch_tokens < max_num_seqs:
            raise ValueError(
                f"max_batch_tokens={max_batch_tokens} must be >= max_num_seqs={max_num_seqs}: "
                "every running question needs one token of each decode pass"
            )
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.cancelled: list[Request] = []

    def add(self, group: list[Request]) -> None:
        """Queue a group submitted together, shortest bucket first (stable inside a bucket)."""
        self.waiting.extend(sorted(group, key=lambda r: bucket_of(len(r.prompt_ids))))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, can_admit: Callable[[Request], bool] = lambda r: True) -> list[Chunk]:
        """Pick this pass's chunks. `can_admit` reserves what a waiting request needs (its
        adapter's slot); a request it refuses stays queued and the next one is tried."""
        budget = self.max_batch_tokens
        chunks: list[Chunk] = []
        for request in self.running:
            pending = min(request.num_tokens - request.num_computed, budget)
            if pending > 0:
                chunks.append(Chunk(request, pending))
                budget -= pending
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[index]
            if request.future.cancelled():
                self.cancelled.append(self.waiting.pop(index))
                continue
            if not can_admit(request):
                index += 1
                continue
            self.waiting.pop(index)
            self.running.append(request)
            take = min(len(request.prompt_ids), budget)
            chunks.append(Chunk(request, take))
            budget -= take
        return chunks

    def take_cancelled(self) -> list[Request]:
        """Requests whose caller cancelled them, waiting or running: they leave now, and their
        resources (adapter pins, KV cache) are the engine's to release."""
        running = [r for r in self.running if r.future.cancelled()]
        self.running = [r for r in self.running if not r.future.cancelled()]
        cancelled, self.cancelled = self.cancelled + running, []
        return cancelled

    def finish(self, request: Request) -> None:
        self.running.remove(request)

    def drain(self) -> list[Request]:
        """Remove and return every request (engine shutdown)."""
        requests = self.waiting + self.running + self.cancelled
        self.waiting, self.running, self.cancelled = [], [], []
        return requests
