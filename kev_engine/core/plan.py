"""Plan: what the scheduler hands the model runner (`Plan`, its `Chunk`s), and the pass it is
planning, with what is left of its budgets (`PassBudget`).

A chunk is some tokens of one question run in a pass (with the draft tokens riding after its one
known token, where speculation drafts). A pass being planned counts its tokens, logits rows and
work in flops against `max_batch_tokens`, `max_logits_tokens` and the pass target (the cost model's
prediction), so that the scheduler's steps (`schedule`) each take what is left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .pass_cost import pairs
from .request import Request

if TYPE_CHECKING:
    from .schedule import Scheduler

MIN_CHUNK = 16  # tokens a prompt gets in a pass that has room for nothing else: progress, however slow
ALONE_FACTOR = 2.0  # a pass holding one batch alone: fewer passes (each streams the weights), a newcomer
# still starts within about three targets
FIRST_PASS_TOKENS = 256  # a time-bounded engine's passes before one was timed: short, so it learns at once


@dataclass(frozen=True)
class Chunk:
    """`num_tokens` of `request` starting at `request.num_computed`, run this pass: its known
    tokens, then its `draft`'s."""

    request: Request
    num_tokens: int
    needs_logits: bool
    """It reaches the request's last known token, so its last row's logits are sampled from
    (never for prompt_logits, whose every row is kept: `Request.all_logits`). Fixed when planned:
    `num_computed` moves once the pass has run."""
    draft: tuple[int, ...] = ()
    """Tokens the answer may write next (`drafts`), each a row after its one known token, each
    row's logits kept: the pass's records take those the answer writes."""


@dataclass
class Plan:
    """One pass as the scheduler hands it to the model runner: its chunks in row order (a
    segment's adapter rows contiguous), the KV blocks handed out since the last plan (cleared
    before the forward by backends that read whole blocks: `BlockManager.take_fresh`), and the
    adapters resident on the device for its rows."""

    chunks: list[Chunk]
    fresh: list[int] = field(default_factory=list)
    resident: dict[str, Any] = field(default_factory=dict)


class PassBudget:
    """One pass being planned (`Scheduler.schedule`): its chunks and what is left of its token,
    logits and time budgets."""

    def __init__(self, scheduler: Scheduler, timed: bool = True, share: float = 1.0,
                 in_flight: frozenset[int] = frozenset()) -> None:
        """`timed`: the pass target bounds it (else tokens, logits and KV alone); `share`: of it;
        `in_flight`: ids of a paused pass's requests (`Scheduler.schedule`)."""
        self.chunks: list[Chunk] = []
        self.requests: set[int] = set()  # ids of the requests in it
        self.in_flight = in_flight
        self.continued = 0  # chunks of prompts already under way
        self.admitted = 0  # requests admitted from the queue
        self.tokens_left = scheduler.max_batch_tokens
        self.logits_left = scheduler.max_logits_tokens
        cost = scheduler.cost
        self.model = cost  # counts the work whenever there is one (it learns from it), predicts only when timed
        self.dense = self.attention = 0.0
        bounded = cost if timed and cost is not None and math.isfinite(scheduler.pass_time_s) else None
        if bounded is not None and not bounded.ready:  # not timed yet: a short pass, so it learns at once
            self.tokens_left = min(self.tokens_left, max(FIRST_PASS_TOKENS, len(scheduler.running)))
        self.cost = bounded if bounded is not None and bounded.ready else None  # predicts: a target, a timed pass
        self.target = math.inf  # the pass's seconds, where it predicts
        if self.cost is not None:  # one batch alone (nobody else waits or answers) may take ALONE_FACTOR targets
            alone = len({r.group for r in scheduler.running} | {r.group for r in scheduler.waiting}) <= 1
            self.target = scheduler.pass_time_s * (ALONE_FACTOR if alone else 1.0) * share
        self.budget: float | None = None  # the flops `target` holds: asked of the cost model when first needed

    @property
    def flops_left(self) -> float:
        """What is left of the pass's time budget, in flops (`CostModel.units`): its target's work
        less the chunks planned so far. Reckoned when a prompt asks, not before: a pass of decode
        steps alone (each takes its token whatever the budget) never asks, and the cost model fits
        nothing for it."""
        if self.cost is None:
            return math.inf
        if self.budget is None:
            self.budget = self.cost.pass_flops(self.target, at_least=self.cost.units(FIRST_PASS_TOKENS, 1, 0))
        return self.budget - (self.dense + self.cost.attention_ratio * self.attention)

    def clip(self, request: Request, take: int) -> int:
        """`take` within what the request has left and the pass's token and logits caps."""
        take = min(take, request.num_tokens - request.num_computed, self.tokens_left)
        return min(take, self.logits_left) if request.all_logits else take

    def fit(self, request: Request, flops: float) -> int:
        """The longest next chunk of `request` whose work fits `flops` (the caps applied)."""
        if self.cost is None or math.isinf(flops):
            return self.clip(request, 1 << 40)
        if request.all_logits:  # every position is a logits row too
            share = self.cost.work.per_token / (self.cost.work.per_token + self.cost.work.per_row)
            return self.clip(request, int(self.cost.tokens_within(flops * share, request.num_computed, 0)))
        return self.clip(request, self.cost.tokens_within(flops, request.num_computed, 1))

    def least(self, request: Request, waiting: bool) -> int:
        """What a prompt gets even when no time is left: MIN_CHUNK tokens for the first prompt under
        way planned (the one with the least left; the longest gets its own MIN_CHUNK in `schedule`)
        and for the first waiting one, so neither the prompts under way nor the queue ever stall (a
        mispredicted pass cannot starve them); nothing for the others."""
        first = not self.admitted if waiting else not self.continued
        return self.clip(request, MIN_CHUNK) if first else 0

    def add(self, chunk: Chunk, decode: bool, admitted: bool = False) -> None:
        request = chunk.request
        self.chunks.append(chunk)
        self.requests.add(id(request))
        self.admitted += admitted
        self.continued += not decode and not admitted
        self.tokens_left -= chunk.num_tokens
        if request.all_logits:
            self.logits_left -= chunk.num_tokens
        if self.model is not None:  # the pass's work so far: the cost model learns it, `flops_left` spends it
            rows = chunk.num_tokens if request.all_logits else int(chunk.needs_logits)
            self.dense += self.model.work.dense(chunk.num_tokens, rows)
            self.attention += self.model.work.per_pair * pairs(request.num_computed, chunk.num_tokens)

    def extend(self, index: int, draft: tuple[int, ...]) -> None:
        """Chunk `index`, one decoding token, goes on with `draft`'s rows (each with its logits)."""
        chunk = self.chunks[index]
        request, rows = chunk.request, len(draft)
        self.chunks[index] = Chunk(request, chunk.num_tokens + rows, chunk.needs_logits, draft)
        self.tokens_left -= rows
        if self.model is not None:
            self.dense += self.model.work.dense(rows, rows)
            self.attention += self.model.work.per_pair * (pairs(request.num_computed, 1 + rows)
                                                         - pairs(request.num_computed, 1))
