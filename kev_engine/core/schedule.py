"""Schedule: the owner of every request from the moment it is queued until it leaves, and which
tokens of which questions run in the next pass — within a time budget, a token cap and the KV
memory budget, fairly.

What it owns (`Scheduler`, every method under the engine's lock): the queue and each request's
status; its KV blocks (through `BlockManager`) and its adapter's slot on the device (through the
adapter pool: taken at admission and at a fork, given back at preemption and when it leaves);
the samples of an n > 1 request, forked from its prefill (`fork`, `fanout`); cancelling, finishing,
failing and draining. A pass leaves it as a `Plan` for the model runner; what the pass computed
comes back through `update` (and `computed`, `drafted` for the draft walk).

A pass that can pause between its layers (Kev's own model: `schedule(whole=True)`, see
`stepper`) is not bounded by time: its prompts run whole, and the passes run between its slices
(`in_flight`, `share`) are bounded as below. What follows is the time-bounded pass.

A pass is bounded by a target duration (`pass_time_s`, predicted by the `pass_cost` model this
engine learns as it runs) and by `max_batch_tokens`. While one submitted batch is all the engine
has (nobody else waiting or answering), its passes may take `plan.ALONE_FACTOR` targets: every pass
streams all the weights once, so fewer, longer passes finish a batch sooner, and a question
arriving meanwhile still starts within about three targets. What goes in, in this order:
1. every running question's next token (a decode is one token): nobody who is answering stalls;
2. prompts already under way continue in chunks, the shortest left first, then the longest.
   When the waiting prompts and the shorter ones that can finish in this pass fit beside the
   longest's least (`MIN_CHUNK` tokens or `LEAST_SHARE` of the time left, whichever is less) and
   a token of each other long prompt, they all finish in this pass: a short question that
   arrives while long prompts run has its first token one pass after the one it arrived in, and
   the long ones share what is left, the shortest left first. Otherwise the longest keeps
   `LONG_SHARE` of the time left (never under `MIN_CHUNK` tokens), and a shorter prompt that
   cannot finish in this pass either leaves the waiting prompts their need first. A long prompt
   always moves;
3. waiting questions join in arrival-group order (shortest bucket first inside a group) while
   time, tokens, sequence slots and KV blocks last: a short question queued behind a long prompt
   is admitted in the very next pass, a group that fits is one pass, and a larger one runs in
   consecutive passes, started in its order. A question whose prompt begins with full blocks that
   a prompt under way computes in a later pass (twenty questions on one document) waits for them
   instead of computing them a second time beside it; it then starts after them, cached;
4. with speculation on, a decoding question's draft (`drafts`) rides as extra rows of its token's
   chunk where the pass is predicted to make more tokens per second with it (`_drafts`).
Each chunk gets the KV blocks it needs; when the pool is full, the most recently admitted
question not already in this pass is preempted (its blocks freed, its tokens recomputed later —
cheaply, since its computed full blocks stay in the prefix cache). A new question starts after
the longest prefix of full blocks already computed — by an earlier pass, or by an earlier chunk
of this one. Finished questions leave: nothing is computed for them again (continuous batching).
Where chunks end never changes a question's numbers on the batch-invariant path.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from ..errors import KevError
from ..inputs.intake import Prepared
from ..inputs.params import Defaults
from . import fanout
from .blocks import BlockManager, BlockTable
from .drafts import MAX_DRAFT, Acceptance, Drafter
from .latency import Histogram
from .pass_cost import CostModel, RowCost, pairs
from .plan import FIRST_PASS_TOKENS, MIN_CHUNK, Chunk, PassBudget, Plan
from .request import Request, Status

BUCKET = 128
WATERMARK = 0.01  # share of blocks kept free at admission, so running decodes rarely preempt
LONG_SHARE = 0.5  # of a pass's time left after decodes, what the longest prompt under way keeps while
# the others and the queue need more than the pass holds
LEAST_SHARE = 0.1  # of a pass's time left, the least the longest prompt under way keeps while the
# others and the queue all finish in the pass (MIN_CHUNK tokens at most, a token at least)
DRAFT_MARGIN = 2.0  # a draft token joins where it is predicted to pay this many times its rows' cost: in a
# batch the longest answers set the passes, and a token taken from a shorter one saves none of them


def shared_blocks(a: Sequence[int], b: Sequence[int], size: int, limit: int) -> int:
    """How many leading full blocks of `size` tokens `a` and `b` have equal, at most `limit`: list
    comparisons (in C) over a binary search, not a Python loop over tokens."""
    high = min(limit, len(a) // size, len(b) // size)
    if a[: high * size] == b[: high * size]:
        return high
    low = 0  # low blocks equal, high not
    while low < high - 1:
        middle = (low + high) // 2
        if a[: middle * size] == b[: middle * size]:
            low = middle
        else:
            high = middle
    return low


def bucket_of(num_tokens: int) -> int:
    """Length bucket: prompts within the same `BUCKET`-token step count as equally long."""
    return (num_tokens + BUCKET - 1) // BUCKET


class AdapterSlots(Protocol):
    """What the scheduler needs of the adapter pool (`adapters.pool.AdapterPool`): a queued
    request holds a reference to its adapter (it stays loaded), a running one a slot on the device."""

    def ref(self, name: str | None) -> None: ...
    def unref(self, name: str | None) -> None: ...
    def acquire(self, name: str | None) -> bool: ...
    def release(self, name: str | None) -> None: ...
    def prefix_key(self, name: str | None) -> Any: ...


class NoAdapters:
    """The adapter slots of a scheduler driven without an engine (tests, benchmarks): no request
    may name an adapter."""

    def ref(self, name: str | None) -> None:
        if name is not None:
            raise ValueError(f"adapter {name!r}: this scheduler was built without an adapter pool")

    def unref(self, name: str | None) -> None:
        pass

    def acquire(self, name: str | None) -> bool:
        self.ref(name)
        return True

    def release(self, name: str | None) -> None:
        pass

    def prefix_key(self, name: str | None) -> Any:
        return None


SCHEDULER_STATS = ("requests", "prompt_tokens", "prefix_hit_tokens", "cancelled", "forked_samples",
                   "draft_tokens", "draft_accepted_tokens")


class Scheduler:
    """Every request's owner from the moment it is queued until it leaves: its status, its KV
    blocks and its adapter's slot (admission, preemption, forks, freeing), and which of its
    tokens each pass runs. Every method runs under the engine's lock."""

    def __init__(
        self, max_batch_tokens: int, max_num_seqs: int, blocks: BlockManager, max_logits_tokens: int = 1024,
        cost: CostModel | None = None, pass_time_s: float = math.inf, adapters: AdapterSlots | None = None,
        max_context: int | None = None, on_cancel: Callable[[Future[Any]], None] = lambda future: None,
    ) -> None:
        """`cost` predicts a pass's seconds; `pass_time_s` is the target (inf, or no `cost`: tokens
        only); `adapters`: the pool whose slots running requests hold; `max_context`: what a
        request's prompt and answer may reach; `on_cancel`: called when a request's future is
        done from outside (its caller cancelled it), to wake the engine's worker."""
        if max_batch_tokens < max_num_seqs:
            raise ValueError(
                f"max_batch_tokens={max_batch_tokens} must be >= max_num_seqs={max_num_seqs}: "
                "every running question needs one token of each decode pass"
            )
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_logits_tokens = max_logits_tokens
        self.blocks = blocks
        self.cost = cost
        self.pass_time_s = pass_time_s
        self.planned = (0.0, 0.0)  # (dense, attention) flops of the last pass planned, for `update` to time
        self.watermark = int(blocks.num_blocks * WATERMARK)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.cancelled: list[Request] = []
        self.preemptions = 0
        self.speculative = False  # decoding questions' drafts join passes where they pay (`_drafts`)
        self.drafter: type[Drafter] = Drafter  # where drafts come from: its own text, or a draft model's
        self.acceptance = Acceptance()  # how often drafts were taken: what their rows are worth
        self.rows_alike: Callable[[int], int] = lambda rows: rows  # `Platform.rows_alike`, at the model's dtype
        # whether blocks holding generated tokens become findable by later prompts: not where a
        # prompt's rows take another arithmetic (`Ops.prompt_arithmetic`), since a prompt that
        # computed those tokens itself would have other bits in them
        self.keys_answers = True
        self.row_cost = RowCost()  # what a decode pass's rows cost, measured
        self.adapters: AdapterSlots = adapters if adapters is not None else NoAdapters()
        self.max_context = max_context
        self.on_cancel = on_cancel
        self.stats: dict[str, int] = dict.fromkeys(SCHEDULER_STATS, 0)
        self.peak_blocks = 0  # the most KV blocks a planned pass held
        self.queue_seconds = Histogram()  # each request, submitted to first admitted
        self.emptied = True  # nothing queued or running once the last finished requests were freed
        self._request_ids = itertools.count()
        self._groups = itertools.count()

    # ---- requests in ------------------------------------------------------------------------

    def submit(self, prepared: Sequence[Prepared], defaults: Defaults,
               on_text: Sequence[Callable[[str], None] | None] | None = None, all_logits: bool = False,
               capture_logits: bool = False, follow_up: bool = False) -> list[Request | BaseException]:
        """Queue every valid request as one group (one settings snapshot: an update never splits
        it); a refused one stays its error. An n > 1 request is its samples, the first leading
        (`fanout`): returned is the leader, the others its `siblings`. `follow_up`: the group is
        an expected follow-up (`arrivals`)."""
        out: list[Request | BaseException] = []
        group_id = next(self._groups)
        group: list[Request] = []
        for i, item in enumerate(prepared):
            if isinstance(item, BaseException):
                out.append(item)
                continue
            ids, params, adapter, compiled = item
            resolved = params.with_defaults(defaults)
            samples = fanout.sample_settings(resolved) if resolved.n > 1 else [resolved]
            try:
                for _ in samples:
                    self.adapters.ref(adapter)  # unloaded since intake? then this request fails alone
            except KevError as exc:
                out.append(exc)
                continue
            limit = len(ids) + params.max_tokens
            requests = [Request(
                request_id=next(self._request_ids),
                prompt_ids=ids,
                sampling=sample,
                settings_version=defaults.version,
                max_total=len(ids) + 1 if all_logits else min(limit, self.max_context or limit),
                adapter=adapter,
                prefix_key=(self.adapters.prefix_key(adapter), params.cache_salt),
                all_logits=all_logits,
                capture_logits=capture_logits,
                blocks=BlockTable(cacheable=not all_logits),
                group=group_id,
                follow_up=follow_up,
                on_text=on_text[i] if on_text is not None else None,
                grammar=None if all_logits else compiled,
                logprobs=[] if sample.logprobs else None,
                sample_index=index,
                drafter=self.drafter() if self.speculative and not all_logits else None,
            ) for index, sample in enumerate(samples)]
            leader = requests[0]
            leader.siblings = requests[1:]  # they fork from its prefill (see `fanout`)
            for request in requests:
                request.mailbox = leader.mailbox  # one on_text: the samples' pieces and results in one order
                request.future.add_done_callback(self.on_cancel)
            group.append(leader)
            out.append(leader)
        self.add(group)
        self.stats["requests"] += len(group)
        return out

    def add(self, group: list[Request]) -> None:
        """Queue a group submitted together, shortest bucket first (stable inside a bucket)."""
        self.waiting.extend(sorted(group, key=lambda r: bucket_of(len(r.prompt_ids))))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self, defer: Callable[[Request], bool] = lambda r: False, in_flight: frozenset[int] = frozenset(),
             whole: bool = False, share: float = 1.0, resident: Callable[[], dict[str, Any]] = dict) -> Plan:
        """The next pass (`schedule`), its chunks in row order with each adapter's rows together,
        the blocks to clear before it, and `resident()`: the adapters on the device."""
        chunks = self.schedule(defer, in_flight, whole, share)
        self.peak_blocks = max(self.peak_blocks, self.blocks.num_used)
        chunks.sort(key=lambda c: (c.request.adapter is not None, c.request.adapter or ""))
        return Plan(chunks, self.blocks.take_fresh(), resident() if chunks else {})

    def schedule(
        self,
        defer: Callable[[Request], bool] = lambda r: False,
        in_flight: frozenset[int] = frozenset(),
        whole: bool = False,
        share: float = 1.0,
    ) -> list[Chunk]:
        """Pick this pass's chunks and give each the KV it needs, and each request it admits its
        adapter's slot (`_admit`). A waiting request that `defer` names stays queued this pass
        (the follow-ups it waits for join it).

        `in_flight`: ids of the requests of a pass paused between its layers: none of them is in
        this one, nor preempted. `whole`: this pass can pause (`Stepper`), so time does not bound
        it: every prompt it can take runs whole (`max_batch_tokens` and the KV budget still do),
        and the running answers' next tokens join it only where it is predicted to fit the target
        (otherwise they run in the passes between its slices, a token each). `share`: of the pass
        target, what this pass may take (a pass between two slices takes part of one: a running
        answer waits for both)."""
        plan = PassBudget(self, timed=not whole, share=share, in_flight=in_flight)
        running = [r for r in self.running if id(r) not in in_flight]
        decoding = [r for r in running if r.decoding]
        continuing = [r for r in running if r not in decoding]
        if not whole:
            self._decodes(plan, decoding)  # 1. every running answer's next token
        if continuing:  # 2. prompts under way, the shortest left first; then the longest
            self._under_way(plan, continuing)
        self._admit_waiting(plan, defer, whole)  # 3. waiting questions, in order
        if whole and (not plan.chunks or self._decodes_fit(plan, len(decoding))):
            self._decodes(plan, decoding)
        if self.speculative:
            self._drafts(plan, share)  # 4. drafts, where they pay
        self.planned = (plan.dense, plan.attention)
        return plan.chunks

    def _decodes(self, plan: PassBudget, decoding: list[Request]) -> None:
        for request in decoding:
            if request.status is Status.RUNNING and plan.tokens_left > 0:
                self._continue(plan, request, 1, decode=True)

    def _drafts(self, plan: PassBudget, share: float) -> None:
        """Step 4: each decoding question's draft, its rows priced by the cost model. A pass of
        `tokens` sampled rows predicted at `seconds` makes tokens / seconds; a draft token taken
        with chance p (`Acceptance`) at `extra` seconds more (the cost model's prediction of its
        flops, or what a decode row was measured to cost where that is more: `RowCost`) raises
        that rate while p x seconds > tokens x extra, and joins where it does by DRAFT_MARGIN,
        likeliest first, while the pass stays within its target, in rows that keep the pass's
        product shape (`Platform.rows_alike`: past it each weight is read again, or by a slower
        kernel, which the cost model's flops do not see), and in free KV blocks (a draft never
        preempts). Before a pass is timed: none."""
        rows = sum(chunk.num_tokens for chunk in plan.chunks)
        room = min(self.rows_alike(rows) - rows, plan.tokens_left)
        seconds = self.predict(plan.dense, plan.attention) if room > 0 else None
        limit_s = self.pass_time_s * share
        if self.cost is None or seconds is None or seconds > limit_s:
            return
        offers: list[tuple[float, int, int]] = []  # (chance, chunk index, depth from 1)
        drafts: dict[int, list[int]] = {}
        for index, chunk in enumerate(plan.chunks):
            request = chunk.request
            if request.drafter is None or chunk.num_tokens != 1 or not request.decoding:
                continue
            limit = _draft_limit(request, room)
            draft = request.drafter.propose(request.all_ids, limit) if limit > 0 else []
            if draft:
                drafts[index] = draft
                chances = self.acceptance.chances(request.drafter, len(draft))
                offers += [(chance, index, depth) for depth, chance in enumerate(chances, 1)]
        offers.sort(key=lambda offer: (-offer[0], offer[2]))  # a question's depths stay in order
        tokens, dense, attention = float(sum(c.needs_logits for c in plan.chunks)), plan.dense, plan.attention
        depths = dict.fromkeys(drafts, 0)
        measured = self.row_cost.per_row() or 0.0
        for chance, index, depth in offers[:room]:
            request = plan.chunks[index].request
            more_dense = dense + self.cost.work.dense(1, 1)
            more_attention = attention + self.cost.work.per_pair * (request.num_computed + depth + 1)
            more = self.predict(more_dense, more_attention)
            if more is None:
                break
            more = max(more, seconds + measured)
            if more > limit_s or not _draft_pays(chance, seconds, tokens, more - seconds):
                break
            depths[index] = depth
            seconds, tokens, dense, attention = more, tokens + chance, more_dense, more_attention
        for index, depth in depths.items():
            request = plan.chunks[index].request
            while depth > 0 and not self.blocks.grow(request.blocks, request.num_computed + 1 + depth, self.watermark):
                depth -= 1
            if depth > 0:
                plan.extend(index, tuple(drafts[index][:depth]))

    def wanted_drafts(self, in_flight: frozenset[int] = frozenset()) -> list[tuple[Request, list[int], int]]:
        """The decoding questions a draft model should write for before the next pass is planned:
        (request, its tokens now, the most draft tokens it may take), at most as many questions
        as a pass of their rows has rows to spare in its product shape, the likeliest taken
        first, each its share of those rows, and only those whose first draft token would price
        in beside a pass of decode rows alone (`_drafts` decides for the pass itself): a draft no
        pass takes is not written. None before a pass was timed (no draft is priced in then)."""
        decoding = [r for r in self.running if r.decoding and r.drafter is not None and id(r) not in in_flight]
        rows = len(decoding)
        room = self.rows_alike(rows) - rows if decoding else 0
        seconds = self._decode_seconds(rows) if room > 0 else None
        if seconds is None:
            return []
        extra = max((self._decode_seconds(rows + 1) or seconds) - seconds, self.row_cost.per_row() or 0.0)
        chances = {id(r): self.acceptance.chances(r.drafter, 1)[0] for r in decoding if r.drafter is not None}
        paying = [r for r in decoding if _draft_pays(chances[id(r)], seconds, rows, extra)]
        paying = sorted(paying, key=lambda r: -chances[id(r)])[:room]
        share = -(-room // len(paying)) if paying else 0  # each its share of the spare rows: no draft token
        # is written that the pass has no row for (a draft model's passes are as many as its longest draft)
        wanted = [(request, request.all_ids, _draft_limit(request, share)) for request in paying]
        return [item for item in wanted if item[2] > 0]

    def decode_row_seconds(self, rows: int) -> float | None:
        """A decode pass of `rows` questions, predicted, per row: what a taken draft token saves
        there (None before a pass was timed)."""
        seconds = self._decode_seconds(rows)
        return None if seconds is None else seconds / rows

    def _decode_seconds(self, rows: int) -> float | None:
        """A pass of `rows` decode rows alone, predicted from their dense work (None before a pass was timed)."""
        return None if self.cost is None else self.predict(self.cost.work.dense(rows, rows), 0.0)

    def _decodes_fit(self, plan: PassBudget, rows: int) -> bool:
        """Whether `plan` with `rows` decode rows is predicted within the pass target."""
        return self.cost is not None and self._within_target(plan, self.cost.work.dense(rows, rows))

    def _within_target(self, plan: PassBudget, dense: float) -> bool:
        """Whether a pass of `plan` and `dense` more work is predicted within the pass target (False
        before the cost model has timed a pass)."""
        seconds = self.predict(plan.dense + dense, plan.attention)
        return seconds is not None and seconds <= self.pass_time_s

    def _fits_with(self, plan: PassBudget, request: Request) -> bool:
        """Whether `plan` with all of `request`'s prompt is predicted within the target (before
        the cost model has timed a pass: whether they hold at most FIRST_PASS_TOKENS, what such a
        pass holds)."""
        if self.cost is None or not self.cost.ready:
            planned = self.max_batch_tokens - plan.tokens_left
            return planned + len(request.prompt_ids) <= FIRST_PASS_TOKENS
        return self._within_target(plan, self._need(request))

    def predict(self, dense: float, attention: float) -> float | None:
        """A pass's seconds from its planned work (None: the cost model has not timed one yet)."""
        if self.cost is None or not self.cost.ready:
            return None
        return self.cost.predict(dense + self.cost.attention_ratio * attention)

    def has_other_work(self, in_flight: frozenset[int]) -> bool:
        """Whether anything outside a paused pass is queued or running."""
        return bool(self.waiting) or any(id(r) not in in_flight for r in self.running)

    def _admit_waiting(self, plan: PassBudget, defer: Callable[[Request], bool], whole: bool = False) -> None:
        """Step 3. In a pass that can pause (`whole`), the first group waiting joins whole (unless
        prompts under way are in it already), and a later group only while the pass is predicted
        within the target with it: a question that came on its own beside a long batch starts
        between that batch's slices, not after it."""
        index = 0
        first_group: object = None if not plan.chunks else plan  # prompts under way came first: no group joins whole
        while index < len(self.waiting) and plan.tokens_left > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[index]
            if request.future.done():  # cancelled (or failed by its own on_text)
                self.cancelled.append(self.waiting.pop(index))
                continue
            if (whole and first_group is not None and request.group != first_group
                    and not self._fits_with(plan, request)):
                break
            if first_group is None:
                first_group = request.group
            if (request.all_logits and plan.logits_left <= 0) or defer(request):
                index += 1
                continue
            cached = self.blocks.allocate(request.blocks, request.all_ids, request.prefix_key, self.watermark)
            if cached is None:
                break  # the pool is full: later requests wait too (first come, first served)
            if self._waits_for_prefix(request, plan, cached):
                self.blocks.free(request.blocks)
                index += 1
                continue
            request.num_computed = cached
            take = max(plan.fit(request, plan.flops_left), plan.least(request, waiting=True))
            if take <= 0:  # out of time for this pass: it is first in the next
                self.blocks.free(request.blocks)
                request.num_computed = 0
                break
            request.cached_tokens = min(cached, len(request.prompt_ids))
            if not self._admit(request):
                self.blocks.free(request.blocks)
                request.num_computed = request.cached_tokens = 0
                index += 1
                continue
            self.waiting.pop(index)
            self.running.append(request)
            request.status = Status.RUNNING
            plan.add(self._plan(request, take), decode=False, admitted=True)

    def _under_way(self, plan: PassBudget, continuing: list[Request]) -> None:
        """Step 2 (the module docstring): prompts under way, the shortest left first, then the longest
        with what the others and the queue leave it."""
        continuing.sort(key=lambda r: r.num_tokens - r.num_computed)  # stable: older first among equals
        *shorter, longest = continuing
        left = plan.flops_left
        kept, floor, queued = left, MIN_CHUNK, 0.0  # for the longest: what the others (and the queue) leave
        finish = False  # whether the queue and the shorter prompts that can finish here all do, this pass
        needs = [self._need(r) for r in shorter]  # each one's work left, whole
        if math.isfinite(left):
            queued = self._waiting_flops(len(self.running), plan)
            small = queued + sum(need for need in needs if need <= left)  # the queue and what finishes here
            stalled = sum(self._work(r, 1) for r, need in zip(shorter, needs) if need > left)  # other long ones
            least = min(self._work(longest, MIN_CHUNK), left * LEAST_SHARE)
            finish = 0 < small <= left - least - stalled  # a short question's first token one pass after it came
            if finish:  # the longest keeps its least, and whatever the others leave
                kept, floor = least, 1
            else:  # it cannot all finish here (or nothing else wants the time): the longest keeps its share
                kept = max(left * LONG_SHARE, left - queued - sum(needs))
        for request, need in zip(shorter, needs):
            if request.status is Status.RUNNING and plan.tokens_left > 0:
                room, least_tokens = plan.flops_left - kept, plan.least(request, waiting=False)
                if need > room:  # another long prompt: the queue's short ones first,
                    room -= min(queued, max(room, 0.0))  # and it moves by a token at least, not MIN_CHUNK
                    least_tokens = min(least_tokens, plan.clip(request, 1)) if queued else least_tokens
                self._continue(plan, request, max(plan.fit(request, room), least_tokens), decode=False)
        if longest.status is Status.RUNNING and plan.tokens_left > 0:  # never less than `floor`: it moves
            budget = max(kept, plan.flops_left - queued) if finish else min(kept, plan.flops_left)
            want = max(plan.fit(longest, budget), plan.clip(longest, floor))
            self._continue(plan, longest, want, decode=False)

    def _continue(self, plan: PassBudget, request: Request, take: int, decode: bool) -> None:
        """Plan `take` more tokens of a running request (fewer if the caps say so), preempting the
        most recently admitted request not yet in this pass (nor in a paused one) while the pool
        lacks blocks."""
        take = plan.clip(request, take)
        if take <= 0:
            return
        while not self.blocks.grow(request.blocks, request.num_computed + take):
            victim = next((r for r in reversed(self.running)
                           if id(r) not in plan.requests and id(r) not in plan.in_flight), None)
            if victim is None:
                return  # every other holder is in this pass already: this one waits a pass
            self._preempt(victim)
            if victim is request:
                return
        plan.add(self._plan(request, take), decode)

    def _need(self, request: Request) -> float:
        """The work left of a prompt, whole (its attention over what it has computed included)."""
        if self.cost is None:
            return 0.0
        left = request.num_tokens - request.num_computed
        return self.cost.units(left, 1, pairs(request.num_computed, left))

    def _work(self, request: Request, take: int) -> float:
        """The work of a prompt under way's next `take` tokens (fewer if it has fewer left), no logits."""
        if self.cost is None:
            return 0.0
        take = min(take, request.num_tokens - request.num_computed)
        return self.cost.units(take, 0, pairs(request.num_computed, take))

    def _waiting_flops(self, running: int, plan: PassBudget) -> float:
        """The work of admitting the waiting prompts that have sequence slots and will not wait for
        a prompt under way (`_waits_for_prefix`), whole."""
        return sum(self._need(r) for r in self.waiting[: max(0, self.max_num_seqs - running)]
                   if not self._waits_for_prefix(r, plan, 0))

    def _waits_for_prefix(self, request: Request, plan: PassBudget, cached: int) -> bool:
        """Whether a prompt under way shares full blocks with the start of `request`'s prompt beyond
        both `cached` and what it will have computed by the end of this pass: admitted now, the
        request would compute those blocks a second time beside it; next pass they may be cached.
        Never for a prompt of a paused pass: that pass may run for many targets yet, and a
        question beside it computes the blocks again rather than wait for it."""
        if not request.blocks.cacheable:
            return False
        under_way = [other for other in self.running if other is not request and other.in_prefill
                     and other.blocks.cacheable and other.prefix_key == request.prefix_key
                     and id(other) not in plan.in_flight]
        if not under_way:
            return False
        size = self.blocks.block_size
        limit = (len(request.prompt_ids) - 1) // size  # a prompt's last token is never matched
        planned = {id(c.request): c.request.num_computed + c.num_tokens for c in plan.chunks}
        for other in under_way:
            done = max(cached, planned.get(id(other), other.num_computed)) // size
            if done < limit and shared_blocks(request.prompt_ids, other.prompt_ids, size, limit) > done:
                return True
        return False

    def _plan(self, request: Request, take: int) -> Chunk:
        # later chunks of this same pass may start after the full blocks this one writes
        self.blocks.announce(request.blocks, request.all_ids, request.prefix_key,
                             self._keyed_upto(request, request.num_computed + take))
        reaches_end = request.num_computed + take == request.num_tokens
        return Chunk(request, take, needs_logits=reaches_end and not request.all_logits)

    def _preempt(self, request: Request) -> None:
        """Free a running request's KV and adapter slot and queue it first again; its tokens so far are kept."""
        self.running.remove(request)
        self.blocks.free(request.blocks)
        self.adapters.release(request.adapter)
        request.status, request.num_computed = Status.WAITING, 0
        self.waiting.insert(0, request)
        self.preemptions += 1

    def _admit(self, request: Request) -> bool:
        """A waiting request whose KV fits takes its adapter's slot, or waits (every slot pinned)."""
        if not self.adapters.acquire(request.adapter):
            return False
        if request.num_admissions == 0:
            self.stats["prompt_tokens"] += len(request.prompt_ids)
            self.queue_seconds.observe(time.monotonic() - request.queued_at)
        self.stats["prefix_hit_tokens"] += request.num_computed
        request.num_admissions += 1
        return True

    # ---- after a pass -----------------------------------------------------------------------

    def update(self, chunks: Sequence[Chunk], seconds: float | None = None,
               planned: tuple[float, float] | None = None) -> None:
        """A pass ran `chunks` in `seconds`: each request's tokens are in its KV now (its full blocks
        committed, findable by later prompts), and the cost model learns what the pass's work took.
        The tokens it drew are the outputs' to record (`unpack.append_token`: stop strings, the
        text)."""
        if seconds is not None and chunks and all(c.request.decoding for c in chunks):
            self.row_cost.observe(sum(c.num_tokens for c in chunks), seconds)  # decode rows alone (drafts too)
        for chunk in chunks:
            self.computed(chunk.request, chunk.num_tokens - len(chunk.draft))  # a draft's rows count once taken
        if self.cost is not None and seconds is not None:
            self.cost.observe(*(planned or self.planned), seconds)

    def pass_ended(self) -> None:
        """A pass's forward ended (or raised): the blocks it was filling are no longer under way."""
        self.blocks.end_pass()

    def swap_filling(self, filling: dict) -> dict:
        """Hide (or give back) the blocks a paused pass is still filling: see `BlockManager.swap_filling`."""
        return self.blocks.swap_filling(filling)

    def computed(self, request: Request, tokens: int) -> None:
        """`tokens` more of `request`'s tokens are in its KV (a chunk's, or a draft token its answer
        took): its full blocks are committed, findable by later prompts."""
        request.num_computed += tokens
        self.blocks.commit(request.blocks, request.all_ids, request.prefix_key,
                           self._keyed_upto(request, request.num_computed))

    def _keyed_upto(self, request: Request, computed: int) -> int:
        """How many of a request's `computed` tokens its findable blocks may cover (`keys_answers`)."""
        return computed if self.keys_answers else min(computed, len(request.prompt_ids))

    def drafted(self, chunks: Sequence[Chunk], taken: dict[int, int], ended: set[int]) -> None:
        """A pass's drafts were walked (`OutputProcessor.walk_drafts`): `taken` maps each drafting
        request's id to the draft tokens its answer took. The acceptance record learns from it,
        and blocks wholly past an answer that goes on (not in `ended`) are freed."""
        for chunk in chunks:
            request = chunk.request
            if chunk.draft and request.drafter is not None:
                self.acceptance.record(request.drafter, len(chunk.draft), taken[id(request)])
                self.stats["draft_tokens"] += len(chunk.draft)
                self.stats["draft_accepted_tokens"] += taken[id(request)]
                if id(request) not in ended:
                    self.blocks.shrink(request.blocks, request.num_tokens)

    def fork(self, leader: Request) -> tuple[list[Request], list[tuple[int, int]]]:
        """The samples waiting on `leader` that start from its prefill now (see `fanout`), and the
        (source, target) KV blocks to copy for them before the next pass writes; those that cannot
        for now (no free block or sequence slot) queue as requests of their own."""
        forked: list[Request] = []
        queued: list[Request] = []
        copies: list[tuple[int, int]] = []
        siblings, leader.siblings = leader.siblings, []
        for sibling in siblings:
            if sibling.future.done():  # its set was cancelled or failed meanwhile
                self.free(sibling)
                continue
            pairs = None
            if len(self.running) < self.max_num_seqs:
                pairs = self.blocks.fork(leader.blocks, sibling.blocks, len(leader.prompt_ids))
            if pairs is None:
                queued.append(sibling)
                continue
            copies += pairs
            self.adapters.acquire(sibling.adapter)  # pinned by the leader already: never refused
            sibling.num_computed = sibling.cached_tokens = len(sibling.prompt_ids)
            sibling.num_admissions = 1  # its prompt tokens were counted with the leader's
            sibling.status = Status.RUNNING
            self.running.append(sibling)
            forked.append(sibling)
        self.waiting[0:0] = queued
        self.stats["forked_samples"] += len(forked)
        return forked, copies

    # ---- requests out -----------------------------------------------------------------------

    def cancel(self, in_flight: frozenset[int] = frozenset()) -> None:
        """Requests whose future is done while they are still here, waiting or running (cancelled
        by their caller, or failed by their own `on_text` on a delivery thread), leave now and
        free what they hold; those of a paused pass (`in_flight`) when it has ended (its next
        layers still write their blocks)."""
        running = [r for r in self.running if r.future.done() and id(r) not in in_flight]
        self.running = [r for r in self.running if not r.future.done() or id(r) in in_flight]
        waiting = [r for r in self.waiting if r.future.done()]
        self.waiting = [r for r in self.waiting if not r.future.done()]
        cancelled, self.cancelled = self.cancelled + waiting + running, []
        for request in cancelled:
            self.free(request)
            self.stats["cancelled"] += request.future.cancelled()  # not those failed by their on_text

    def finish(self, requests: Sequence[Request]) -> None:
        """`requests` are done (answered, or failed alone): they leave and free what they hold."""
        for request in requests:
            if request in self.running:
                self.running.remove(request)
            self.free(request)
        self.emptied = not self.has_work()  # before any caller hears of it: see `Stepper.emptied`

    def fail_running(self) -> list[Request]:
        """A pass raised: every running request leaves with it; returned for their callers to hear."""
        failed = list(self.running)
        self.finish(failed)
        return failed

    def drain(self) -> list[Request]:
        """Engine shutdown: every request leaves; returned for their callers to hear."""
        requests = self.waiting + self.running + self.cancelled
        self.waiting, self.running, self.cancelled = [], [], []
        for request in requests:
            self.free(request)
        return requests

    def free(self, request: Request) -> None:
        """Everything a request holds, given back in one place. Samples still waiting to fork from
        it hold only their adapter references; their set's future settles them."""
        for sibling in request.siblings:
            self.free(sibling)
        request.siblings = []
        if request.status is Status.FINISHED:
            return
        if request.status is Status.RUNNING:
            self.blocks.free(request.blocks)
            self.adapters.release(request.adapter)
        self.adapters.unref(request.adapter)
        request.status = Status.FINISHED
        request.drafter = None  # its n-gram index: a few MB for a prompt of thousands of tokens


def _draft_pays(chance: float, seconds: float, tokens: float, extra: float) -> bool:
    """Whether a draft token taken with `chance`, for `extra` seconds beside a pass of `tokens`
    sampled rows predicted at `seconds`, raises its tokens per second by DRAFT_MARGIN (`_drafts`)."""
    return chance * seconds > DRAFT_MARGIN * tokens * extra


def _draft_limit(request: Request, room: int) -> int:
    """The most draft tokens `request` may take: MAX_DRAFT, the pass's spare rows, and its answer's
    room (a draft never reaches its last allowed token: that token is drawn, not verified)."""
    return min(MAX_DRAFT, room, request.max_total - request.num_tokens - 1,
               request.sampling.max_tokens - len(request.output_ids) - 1)
