"""Schedule: which tokens of which questions run in the next pass — under a token budget AND
the KV memory budget.

Running questions go first (a decode is one token; a long prompt continues in chunks), so no
admitted question starves; each gets the KV blocks its chunk needs, and when the pool is full
the most recently admitted question is preempted (its blocks freed, its tokens recomputed
later — cheaply, since its computed full blocks stay in the prefix cache). Then waiting
questions join in arrival-group order, shortest bucket first inside a group, while the token
budget, the sequence slots and the KV blocks last. A new question starts after the longest
prefix of full blocks already computed — by an earlier pass, or by an earlier chunk of this
one. Finished questions leave: nothing is computed for them again (continuous batching).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .blocks import BlockManager
from .request import Request, Status

BUCKET = 128
WATERMARK = 0.01  # share of blocks kept free at admission, so running decodes rarely preempt


def bucket_of(num_tokens: int) -> int:
    """Length bucket: prompts within the same `BUCKET`-token step count as equally long."""
    return (num_tokens + BUCKET - 1) // BUCKET


@dataclass(frozen=True)
class Chunk:
    """`num_tokens` of `request` starting at `request.num_computed`, run this pass."""

    request: Request
    num_tokens: int
    samples: bool
    """It reaches the request's last known token, so a token is sampled after it (never for
    prompt_logits). Fixed when planned: `num_computed` moves once the pass has run."""


class Scheduler:
    def __init__(
        self, max_batch_tokens: int, max_num_seqs: int, blocks: BlockManager, max_logits_tokens: int = 1024
    ) -> None:
        if max_batch_tokens < max_num_seqs:
            raise ValueError(
                f"max_batch_tokens={max_batch_tokens} must be >= max_num_seqs={max_num_seqs}: "
                "every running question needs one token of each decode pass"
            )
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_logits_tokens = max_logits_tokens
        self.blocks = blocks
        self.watermark = int(blocks.num_blocks * WATERMARK)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.cancelled: list[Request] = []
        self.preemptions = 0

    def add(self, group: list[Request]) -> None:
        """Queue a group submitted together, shortest bucket first (stable inside a bucket)."""
        self.waiting.extend(sorted(group, key=lambda r: bucket_of(len(r.prompt_ids))))

    def adopt(self, request: Request) -> None:
        """Run a request whose KV was given to it without admission (a sample forked from its
        set's prefill, `fanout`): it joins the running ones, last admitted."""
        request.status = Status.RUNNING
        self.running.append(request)

    def requeue(self, requests: list[Request]) -> None:
        """Queue requests first (samples of a set already admitted that could not fork)."""
        self.waiting[0:0] = requests

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(
        self,
        can_admit: Callable[[Request], bool] = lambda r: True,
        on_preempt: Callable[[Request], None] = lambda r: None,
    ) -> list[Chunk]:
        """Pick this pass's chunks and give each the KV it needs. `can_admit` reserves what else a
        waiting request needs (its adapter's slot); `on_preempt` gives that back."""
        budget = self.max_batch_tokens
        logits_budget = self.max_logits_tokens
        chunks: list[Chunk] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            take = min(request.num_tokens - request.num_computed, budget)
            if request.logits_only:
                take = min(take, logits_budget)
            if take <= 0:
                index += 1
                continue
            while not self.blocks.grow(request.blocks, request.num_computed + take):
                victim = self.running[-1]
                self._preempt(victim, on_preempt)
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                break  # it was the last one and preempted itself: everything before it is planned
            chunks.append(self._plan(request, take))
            budget -= take
            logits_budget -= take if request.logits_only else 0
            index += 1
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[index]
            if request.future.done():  # cancelled (or failed by its own on_text)
                self.cancelled.append(self.waiting.pop(index))
                continue
            if request.logits_only and logits_budget <= 0:
                index += 1
                continue
            cached = self.blocks.allocate(request.blocks, request.all_ids, request.prefix_key, self.watermark)
            if cached is None:
                break  # the pool is full: later requests wait too (first come, first served)
            request.num_computed = cached
            request.cached_tokens = min(cached, len(request.prompt_ids))
            if not can_admit(request):
                self.blocks.free(request.blocks)
                request.num_computed = request.cached_tokens = 0
                index += 1
                continue
            self.waiting.pop(index)
            self.running.append(request)
            request.status = Status.RUNNING
            take = min(request.num_tokens - cached, budget)
            if request.logits_only:
                take = min(take, logits_budget)
                logits_budget -= take
            chunks.append(self._plan(request, take))
            budget -= take
        return chunks

    def _plan(self, request: Request, take: int) -> Chunk:
        # later chunks of this same pass may start after the full blocks this one writes
        self.blocks.announce(request.blocks, request.all_ids, request.prefix_key, request.num_computed + take)
        reaches_end = request.num_computed + take == request.num_tokens
        return Chunk(request, take, samples=reaches_end and not request.logits_only)

    def _preempt(self, request: Request, on_preempt: Callable[[Request], None]) -> None:
        """Free a running request's KV and queue it first again; its tokens so far are kept."""
        self.running.remove(request)
        self.blocks.free(request.blocks)
        request.status, request.num_computed = Status.WAITING, 0
        on_preempt(request)
        self.waiting.insert(0, request)
        self.preemptions += 1

    def update(self, chunks: Sequence[Chunk], draws: Sequence[tuple[Request, int]] = ()) -> None:
        """A pass ran `chunks`: each request's tokens are in its KV now (its full blocks committed,
        findable by later prompts), and each of `draws` adds its token to its request's output.

        The engine records its draws itself (`unpack.append_token`: stop strings, the text) and
        passes none; a test driving the scheduler alone passes them."""
        for chunk in chunks:
            request = chunk.request
            request.num_computed += chunk.num_tokens
            self.blocks.commit(request.blocks, request.all_ids, request.prefix_key, request.num_computed)
        for request, token in draws:
            request.output_ids.append(token)

    def take_cancelled(self) -> list[Request]:
        """Requests whose future is done while they are still here, waiting or running: cancelled
        by their caller, or failed by their own `on_text` (on a delivery thread). They leave now,
        and what they hold is the engine's to free."""
        running = [r for r in self.running if r.future.done()]
        self.running = [r for r in self.running if not r.future.done()]
        waiting = [r for r in self.waiting if r.future.done()]
        self.waiting = [r for r in self.waiting if not r.future.done()]
        cancelled, self.cancelled = self.cancelled + waiting + running, []
        return cancelled

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)

    def drain(self) -> list[Request]:
        """Remove and return every request (engine shutdown)."""
        requests = self.waiting + self.running + self.cancelled
        self.waiting, self.running, self.cancelled = [], [], []
        return requests
