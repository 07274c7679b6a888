"""Lifecycle: every request from the moment it is queued until its caller has its result.

Where this sits: between intake (checked prompts and settings) and delivery (the caller's
future and `on_text`), under the engine's lock. A request is queued with its group, admitted
with its KV blocks and its adapter's slot (`Scheduler.schedule` calls `admit`), advanced by each
pass (`record`), forked when it is a sample of an n > 1 set (`fanout`), streamed, and finished,
cancelled or failed — and whatever it holds is given back in one place (`free`). Each stage
method is one stage of `Stepper.step`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ..adapters.pool import AdapterPool
from ..errors import EngineClosedError, KevError, PassFailedError
from ..inputs.intake import Prepared
from ..inputs.params import Defaults
from ..model.pack import PackedBatch
from ..outputs.completion import TextPiece
from ..outputs.delivery import Delivery, hand_text
from ..outputs.detokenize import Detokenizer
from ..outputs.unpack import append_token, text_delta
from ..sample.grammar import Grammars
from ..sample.logprobs import TokenTexts
from ..sample.sample import Draw, draw_tokens, draws_alone
from . import fanout
from .blocks import BlockManager, BlockTable
from .drafts import Drafter
from .latency import Histogram
from .request import Request, Status, failed_future, resolve_future
from .schedule import Chunk, Scheduler

STAT_KEYS = (
    "requests", "prefill_passes", "decode_steps", "forward_passes", "prompt_tokens", "generated_tokens",
    "cancelled", "prefix_hit_tokens", "kv_cache_peak_bytes", "forked_samples", "pass_slices",
    "draft_tokens", "draft_accepted_tokens",
)
Finished = list[tuple[Request, BaseException | None]]  # each finished request, with its error if it failed


class Lifecycle:
    """The engine's requests and what they hold; every method but the stage ones runs under `cond`."""

    def __init__(self, *, cond: threading.Condition, scheduler: Scheduler, blocks: BlockManager,
                 adapters: AdapterPool, grammars: Grammars, backend: Any, tokenizer: Any,
                 eos_ids: frozenset[int], max_context: int, device: torch.device) -> None:
        self.cond = cond
        self.scheduler = scheduler
        self.blocks = blocks
        self.adapters = adapters
        self.grammars = grammars
        self.backend = backend  # its pool: new blocks cleared, a fork's last block copied
        self.detokenizer = Detokenizer(tokenizer)  # each reply's text, token by token
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.device = device
        self.token_texts = TokenTexts(tokenizer)  # logprobs name their tokens
        self.delivery = Delivery("kev")  # on_text and results reach callers from here, never from a pass
        self.stats: dict[str, Any] = dict.fromkeys(STAT_KEYS, 0)
        self.stats["paused_seconds"] = 0.0
        self.pass_seconds = Histogram()  # each pass, pack to draws
        self.queue_seconds = Histogram()  # each request, submitted to first admitted
        self._request_ids = itertools.count()
        self._groups = itertools.count()
        self.emptied = True  # the last pass left nothing queued or running (set where its requests are freed)

    # ---- requests in (under cond) -----------------------------------------------------------

    def enqueue(self, prepared: Sequence[Prepared], defaults: Defaults,
                on_text: Sequence[Callable[[str], None] | None] | None = None,
                all_logits: bool = False, capture_logits: bool = False, follow_up: bool = False) -> list[Future[Any]]:
        """Queue every valid request as one group (one settings snapshot: an update never splits it);
        a refused one gets an already-failed future. An n > 1 request is its samples, the first
        leading (`fanout`), behind one future. `follow_up`: the group is an expected follow-up."""
        out: list[Future[Any]] = []
        group_id = next(self._groups)
        group: list[Request] = []
        for i, item in enumerate(prepared):
            if isinstance(item, BaseException):
                out.append(failed_future(item))
                continue
            ids, params, adapter, compiled = item
            resolved = params.with_defaults(defaults)
            samples = fanout.sample_settings(resolved) if resolved.n > 1 else [resolved]
            try:
                for _ in samples:
                    self.adapters.ref(adapter)  # unloaded since intake? then this request fails alone
            except KevError as exc:
                out.append(failed_future(exc))
                continue
            requests = [Request(
                request_id=next(self._request_ids),
                prompt_ids=ids,
                sampling=sample,
                settings_version=defaults.version,
                max_total=len(ids) + 1 if all_logits else min(len(ids) + params.max_tokens, self.max_context),
                adapter=adapter,
                prefix_key=(self.adapters.prefix_key(adapter), params.cache_salt),
                all_logits=all_logits,
                capture_logits=capture_logits,
                blocks=BlockTable(cacheable=not all_logits),
                group=group_id,
                follow_up=follow_up,
                on_text=on_text[i] if on_text is not None else None,
                matcher=None if compiled is None or all_logits else self.grammars.matcher(compiled),
                logprobs=[] if sample.logprobs else None,
                sample_index=index,
                drafter=Drafter() if self.scheduler.speculative and not all_logits else None,
            ) for index, sample in enumerate(samples)]
            leader = requests[0]
            leader.siblings = requests[1:]  # they fork from its prefill (see `fanout`)
            for request in requests:
                request.mailbox = leader.mailbox  # one on_text: the samples' pieces and results in one order
                request.future.add_done_callback(functools.partial(_wake_if_cancelled, self.cond))
            group.append(leader)
            out.append(fanout.gather([r.future for r in requests]) if len(requests) > 1 else leader.future)
        self.scheduler.add(group)
        self.stats["requests"] += len(group)
        return out

    # ---- the stages of a pass ---------------------------------------------------------------

    def cancel(self, in_flight: frozenset[int] = frozenset()) -> None:
        """Requests whose caller cancelled them leave now and free what they hold (those of a
        paused pass, `in_flight`, once it has ended)."""
        with self.cond:
            for request in self.scheduler.take_cancelled(in_flight):
                self.free(request)
                self.stats["cancelled"] += request.future.cancelled()  # not those failed by their on_text

    def schedule(self, defer: Callable[[Request], bool] = lambda r: False, in_flight: frozenset[int] = frozenset(),
                 whole: bool = False, share: float = 1.0) -> list[Chunk]:
        """This pass's chunks; each admitted request gets its KV blocks and its adapter's slot
        (`defer`, `in_flight`, `whole`, `share`: see `Scheduler.schedule`)."""
        with self.cond:
            chunks = self.scheduler.schedule(self._admit, lambda r: self.adapters.release(r.adapter), defer,
                                             in_flight, whole, share)
            fresh = self.blocks.take_fresh()
            used = self.blocks.num_used * self.backend.pool.block_bytes
            self.stats["kv_cache_peak_bytes"] = max(self.stats["kv_cache_peak_bytes"], used)
        self.backend.new_blocks(fresh)  # before this pass's forward (passes never overlap)
        chunks.sort(key=lambda c: (c.request.adapter is not None, c.request.adapter or ""))  # adapter rows contiguous
        return chunks

    def resident_adapters(self) -> dict[str, Any]:
        with self.cond:
            return self.adapters.resident_map()

    def end_pass(self) -> None:
        with self.cond:
            self.blocks.end_pass()

    def others_wait(self, in_flight: frozenset[int]) -> bool:
        """Whether anything outside a paused pass is queued or running."""
        with self.cond:
            return self.scheduler.has_other_work(in_flight)

    @contextlib.contextmanager
    def between_slices(self) -> Iterator[None]:
        """A pass run while another is paused: the paused one's blocks under way are hidden from
        it (`BlockManager.swap_filling`)."""
        with self.cond:
            paused = self.blocks.swap_filling({})
        try:
            yield
        finally:
            with self.cond:
                self.blocks.swap_filling(paused)

    def rows_to_sample(self, chunks: list[Chunk], batch: PackedBatch) -> list[tuple[Request, int]]:
        """The logits row each request draws its next token from: every chunk that reached its
        request's last known token — and, at the first token of an n > 1 request, each of its other
        samples, forked from that prefill here (their KV blocks copied from the leader's), so they
        draw from the same row. Sampling itself then touches no KV."""
        plan = [(c.request, batch.logits_rows[i][0]) for i, c in enumerate(chunks) if c.needs_logits]
        return plan + [(sibling, row) for request, row in plan if request.siblings for sibling in self._fork(request)]

    def sample(self, plan: list[tuple[Request, int]], logits: torch.Tensor) -> list[Draw]:
        """One token per planned row (`rows_to_sample`); how a row is drawn is `sample.draw_tokens`'s."""
        if not plan:
            return []
        return draw_tokens(plan, logits, self.eos_ids, self.grammars.vocab_size, self.token_texts)

    def record(self, chunks: list[Chunk], batch: PackedBatch, logits: torch.Tensor, draws: list[Draw],
               seconds: float | None = None, planned: tuple[float, float] | None = None, pauses: int = 0,
               paused_s: float = 0.0) -> Finished:
        """Advance each request by what this pass computed and drew (in `seconds`, its work
        `planned`: the scheduler's cost model learns from it; `pauses`: how often it let other
        passes run between its layers, for `paused_s`); return those that are done."""
        finished: Finished = []
        has_prefill = any(c.request.in_prefill for c in chunks)  # before update() moves them on
        has_decode = any(not c.request.in_prefill for c in chunks)
        with self.cond:
            self.scheduler.update(chunks, seconds=seconds, planned=planned)
            self.stats["pass_slices"] += pauses
            self.stats["paused_seconds"] += paused_s
            if seconds is not None:
                self.pass_seconds.observe(seconds)
            self.stats["forward_passes"] += 1
            self.stats["prefill_passes"] += has_prefill
            self.stats["decode_steps"] += has_decode
            self.stats["generated_tokens"] += len(draws)
        for i, chunk in enumerate(chunks):
            request = chunk.request
            if request.all_logits:
                first, last = batch.logits_rows[i]
                request.logits.append(logits[first:last].clone())  # its own memory, not a view of the pass
                if not request.in_prefill:
                    finished.append((request, None))
        for draw in draws:
            self._take(draw, logits, finished)
        if any(chunk.draft for chunk in chunks):
            self._walk_drafts(chunks, batch, logits, finished)
        return finished

    def _take(self, draw: Draw, logits: torch.Tensor, finished: Finished) -> None:
        """One drawn token onto its request: its logprobs, its text, whether it finished; streamed."""
        request, row, token, logprob = draw
        if isinstance(token, BaseException):
            finished.append((request, token))
            return
        if request.capture_logits:
            request.logits.append(logits[row].clone())
        if logprob is not None and request.logprobs is not None:
            request.logprobs.append(logprob)
        if append_token(request, token, self.eos_ids, self.detokenizer):
            finished.append((request, None))
        self._stream(request)

    def _walk_drafts(self, chunks: list[Chunk], batch: PackedBatch, logits: torch.Tensor, finished: Finished) -> None:
        """Take what each draft got right (`drafts`). Its first row's token is drawn already; while
        the last token drawn is the draft's next one and the answer goes on, that draft token's KV
        (computed at its row) is the answer's, and the row after it is drawn, exactly as the next
        pass of plain decoding would draw it. A draft's rows past the first miss leave their KV
        slots to be written again, and blocks wholly past the answer are freed.

        A row's draw depends on the tokens before it only through penalties, min_tokens, a grammar
        or a generator; a greedy question with none of them has all its rows drawn in one call up
        front (rows it does not reach are dropped), the others depth by depth."""
        ended = {id(request) for request, _ in finished}
        walking = [(chunk, batch.logits_rows[i][0]) for i, chunk in enumerate(chunks) if chunk.draft]
        taken = dict.fromkeys((id(chunk.request) for chunk, _ in walking), 0)
        ahead = [(chunk, first) for chunk, first in walking if draws_alone(chunk.request)]
        drawn_ahead = {(id(draw.request), draw.row): draw for draw in self.sample(
            [(chunk.request, first + depth) for chunk, first in ahead for depth in range(1, len(chunk.draft) + 1)],
            logits)}
        depth = drawn = 0
        while walking:
            depth += 1
            walking = [(chunk, first) for chunk, first in walking if id(chunk.request) not in ended
                       and chunk.request.output_ids[-1] == chunk.draft[depth - 1]]
            with self.cond:
                for chunk, _ in walking:
                    self.scheduler.computed(chunk.request, 1)
                    taken[id(chunk.request)] += 1
            rows = [(chunk.request, first + depth) for chunk, first in walking]
            ready = [drawn_ahead.get((id(request), row)) for request, row in rows]
            draws = iter(self.sample([plan for plan, draw in zip(rows, ready) if draw is None], logits))
            before = len(finished)
            for draw in ready:
                self._take(draw if draw is not None else next(draws), logits, finished)
            ended.update(id(request) for request, _ in finished[before:])
            drawn += len(rows)
            walking = [(chunk, first) for chunk, first in walking if depth < len(chunk.draft)]
        with self.cond:
            self.stats["generated_tokens"] += drawn
            for chunk in chunks:
                request = chunk.request
                if chunk.draft and request.drafter is not None:
                    self.scheduler.acceptance.record(request.drafter, len(chunk.draft), taken[id(request)])
                    self.stats["draft_tokens"] += len(chunk.draft)
                    self.stats["draft_accepted_tokens"] += taken[id(request)]
                    if id(request) not in ended:
                        self.blocks.shrink(request.blocks, request.num_tokens)

    def finish(self, finished: Finished) -> None:
        """Free what finished requests hold, then hand each caller its result (outside the lock)."""
        with self.cond:
            for request, _ in finished:
                self.scheduler.finish(request)
                self.free(request)
            self.emptied = not self.scheduler.has_work()  # before any caller hears of it: see `Stepper.emptied`
        for request, error in finished:
            self._deliver(request, request.result() if error is None else None, error)

    def fail_running(self, exc: BaseException) -> None:
        """A pass raised: its requests fail, each with its own error chained to the cause."""
        with self.cond:
            failed = list(self.scheduler.running)
            for request in failed:
                self.scheduler.finish(request)
                self.free(request)
            self.emptied = not self.scheduler.has_work()
        for request in failed:
            error = PassFailedError(f"the forward pass this request was in failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._deliver(request, None, error)

    def drain(self) -> None:
        """Fail every request still queued or running (under cond, the engine closed)."""
        pending = self.scheduler.drain()
        for request in pending:
            self.free(request)
        for request in pending:
            self._deliver(request, None, EngineClosedError("the engine was closed before this request finished"))

    # ---- what a request holds (under cond) --------------------------------------------------

    def _admit(self, request: Request) -> bool:
        """Called by the scheduler when a request's KV fits: take its adapter slot, or wait."""
        if not self.adapters.acquire(request.adapter):
            return False
        self._seed(request)
        if request.num_admissions == 0:
            self.stats["prompt_tokens"] += len(request.prompt_ids)
            self.queue_seconds.observe(time.monotonic() - request.queued_at)
        self.stats["prefix_hit_tokens"] += request.num_computed
        request.num_admissions += 1
        return True

    def _seed(self, request: Request) -> None:
        """A seeded request's own generator, made once (a preempted one keeps drawing from it)."""
        if request.sampling.seed is not None and request.generator is None:
            request.generator = torch.Generator(device=self.device).manual_seed(request.sampling.seed)

    def _fork(self, leader: Request) -> list[Request]:
        """The samples waiting on `leader` that start from its prefill now (see `fanout`); those
        that cannot for now (no free block or sequence slot) queue as requests of their own."""
        forked: list[Request] = []
        queued: list[Request] = []
        copies: list[tuple[int, int]] = []
        with self.cond:
            siblings, leader.siblings = leader.siblings, []
            for sibling in siblings:
                if sibling.future.done():  # its set was cancelled or failed meanwhile
                    self.free(sibling)
                    continue
                pairs = None
                if len(self.scheduler.running) < self.scheduler.max_num_seqs:
                    pairs = self.blocks.fork(leader.blocks, sibling.blocks, len(leader.prompt_ids))
                if pairs is None:
                    queued.append(sibling)
                    continue
                copies += pairs
                self.adapters.acquire(sibling.adapter)  # pinned by the leader already: never refused
                self._seed(sibling)
                sibling.num_computed = sibling.cached_tokens = len(sibling.prompt_ids)
                sibling.num_admissions = 1  # its prompt tokens were counted with the leader's
                self.scheduler.adopt(sibling)
                forked.append(sibling)
            self.scheduler.requeue(queued)
            self.stats["forked_samples"] += len(forked)
        self.backend.pool.copy_blocks(copies)  # before the next pass writes into the copies
        return forked

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
        self.cond.notify_all()

    # ---- results out ------------------------------------------------------------------------

    def _stream(self, request: Request) -> None:
        """Post a request's new text to its `on_text` (run by the delivery threads, after what it
        was posted before: this pass never waits for the callback). If the callback raises, the
        request's future fails and the next pass frees it (`Scheduler.take_cancelled`). The piece
        carries its sample's index and the logprobs of the tokens since the previous piece."""
        if request.on_text is not None and (delta := text_delta(request)):
            logprobs = None
            if request.logprobs is not None:
                logprobs = request.logprobs[request.logprobs_streamed:]
                request.logprobs_streamed = len(request.logprobs)
            piece = TextPiece(delta, request.sample_index, logprobs)
            self.delivery.post(request.mailbox, functools.partial(hand_text, request.future, request.on_text, piece))

    def _deliver(self, request: Request, result: Any, exc: BaseException | None = None) -> None:
        """Resolve a request's future after every piece of text it streamed (its done callbacks
        then run on a delivery thread, not in a pass)."""
        self.delivery.post(request.mailbox, functools.partial(resolve_future, request.future, result, exc))


def _wake_if_cancelled(cond: threading.Condition, future: Future) -> None:
    """A caller cancelled: wake the scheduler so the request frees what it holds now."""
    if future.cancelled():
        with cond:
            cond.notify_all()
