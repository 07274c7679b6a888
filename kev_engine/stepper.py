"""One pass of the engine, in stage order, each stage its own owner:

    (draft (DraftModel)) → plan (Scheduler) → run (ModelRunner) → sample (Sampler) → record (Scheduler,
    OutputProcessor) → deliver

Where this sits: `Engine` composes the components and hands the worker (`core/worker.py`) this
`Stepper`, a narrow view of them — whether there is work, one step, failing the requests of a
pass that raised, draining on close. The worker holds it only weakly (an engine dropped without
`close()` is collected, and its thread ends), and nothing here calls back into the `Engine`.
The scheduler owns every request's status, KV blocks and adapter slot; the runner is the only
code that touches the model and KV memory; the sampler owns what drawing needs; the outputs
processor puts tokens on their requests and hands callers their text and results. The Stepper
owns the pass counters and holds the engine's lock around every scheduler call.

A pass that pauses: with a time target and Kev's own model, a batch is one pass whatever its size
(`Scheduler.schedule(whole=True)`), and its forward runs in slices: whole layers, or where one
layer alone takes longer than the target (a prompt of thousands of tokens), the next rows of a
layer (`DecoderModel.advance`). A running answer waits a slice and a pass between two tokens, so a
slice is sized to the target less the pass between, by the pace of the last slices in rows and in
the keys those rows attend to (`core/slice_work.py`; the cost model's prediction before any slice
was timed). Between two slices, while
anything else is queued or answering, one ordinary pass runs for it (the running answers' next
tokens, newly arrived questions; nothing of the paused pass, whose blocks under way it cannot
see), then the paused pass resumes. Alone on the engine it runs to its end. Its rows are the same
bits either way: the kernels are batch-invariant, and between its slices it holds only its hidden
states.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Iterator

import torch

from .core.arrivals import Arrivals
from .core.latency import Histogram
from .core.plan import Chunk, Plan
from .core.request import Request
from .core.schedule import Scheduler
from .core.slice_work import WINDOW, SlicePace, SliceWork
from .draft_model import DraftModel
from .errors import EngineClosedError, PassFailedError
from .model.pack import PackedBatch
from .outputs.processor import Finished, OutputProcessor
from .runner import ModelRunner
from .sample.sample import Sampler, draws_alone

SLICE_AIM = 0.9  # of a slice's time, what its rows are sized to at the slices' pace: the wait between two of a
# running answer's tokens also holds their sampling and delivery, and the target is that wait's p99
LEAST_SLICE = 0.25  # of the target, the least a slice aims at however long the passes between take
MIN_SLICE_ROWS = 64  # a slice's least rows of a layer: fewer would cost more in calls than they save
BETWEEN_SHARE = 0.5  # of the pass target, what a pass between two slices may take (a prompt that came
# meanwhile goes on in chunks there): a running answer waits a slice and that pass between two tokens


PASS_STATS = ("forward_passes", "prefill_passes", "decode_steps", "pass_slices")
"""Every pass is a prefill pass (it holds prompt tokens, and maybe decode rows beside them) or a
decode step (decode rows alone): the two add up to `forward_passes`. `pass_slices`: how often a
pass paused between its layers."""


class Stepper:
    def __init__(self, *, cond: threading.Condition, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler,
                 outputs: OutputProcessor, arrivals: Arrivals, drafts: DraftModel | None = None) -> None:
        self.cond = cond  # the engine's lock: every scheduler call holds it
        self.drafts = drafts  # a draft model writes the decoding questions' drafts before each plan
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.outputs = outputs
        self.arrivals = arrivals
        self.pace = SlicePace()  # what the last slices' rows and keys took
        self.betweens: collections.deque[float] = collections.deque(maxlen=WINDOW)  # the last passes between
        self.stats: dict[str, float] = dict.fromkeys(PASS_STATS, 0)
        self.stats["paused_seconds"] = 0.0
        self.pass_seconds = Histogram()  # each pass, pack to draws

    @contextlib.contextmanager
    def _scheduling(self) -> Iterator[None]:
        """The engine's lock around scheduler calls; waiters (`Engine.wait_for_unload`) hear of
        what they freed."""
        with self.cond:
            yield
            self.cond.notify_all()

    def has_work(self) -> bool:
        """Anything queued or running (called under the engine's lock)."""
        return self.scheduler.has_work()

    def step(self) -> int:
        """One pass; the number of tokens it ran (0: nothing could run). The caller holds the
        worker's pass lock (`Worker.run_pass`), never the engine's: each stage takes it itself."""
        whole = self.runner.num_layers is not None and math.isfinite(self.scheduler.pass_time_s)
        plan = self._plan(whole=whole)
        if not plan.chunks:
            return 0
        return self._in_slices(plan) if whole else self._whole(plan)

    def _plan(self, in_flight: frozenset[int] = frozenset(), whole: bool = False, share: float = 1.0) -> Plan:
        """A draft model writes the decoding questions' drafts (outside the lock: it runs passes of
        its own), cancelled requests leave (those of a paused pass, `in_flight`, once it has ended),
        then the scheduler plans the next pass."""
        if self.drafts is not None:
            with self.cond:
                wanted = self.scheduler.wanted_drafts(in_flight)
            self.drafts.prepare(wanted)
        with self._scheduling():
            self.scheduler.cancel(in_flight)
            return self.scheduler.plan(self._defer, in_flight, whole, share, self.runner.resident_adapters)

    def _whole(self, plan: Plan) -> int:
        """One pass of `plan`, start to end; the tokens it ran."""
        started = time.perf_counter()
        try:
            batch, logits = self.runner.run(plan)  # [K, vocab]
        finally:
            self._ended()
        self._record(plan.chunks, batch, logits, time.perf_counter() - started)
        return batch.num_tokens

    def _ended(self) -> None:
        with self.cond:
            self.scheduler.pass_ended()

    def _record(self, chunks: list[Chunk], batch: PackedBatch, logits: torch.Tensor, seconds: float,
                planned: tuple[float, float] | None = None, pauses: int = 0, paused_s: float = 0.0) -> None:
        """After the forward: draw each sampled row's token, record what the pass computed (the
        scheduler: KV and the cost model's lesson in `seconds` of `planned` work; the outputs:
        tokens and text), walk the drafts, free the finished and tell their callers. `pauses`:
        how often the pass let others run between its layers, for `paused_s`."""
        draws = self.sampler.sample(self._rows_to_sample(chunks, batch), logits)
        has_prefill = any(c.request.in_prefill for c in chunks)  # before update() moves them on
        with self.cond:  # `Engine.stats` reads the counters under it
            self.scheduler.update(chunks, seconds=seconds, planned=planned)
            self.stats["forward_passes"] += 1
            self.stats["prefill_passes" if has_prefill else "decode_steps"] += 1  # disjoint: they add up to all
            self.stats["pass_slices"] += pauses
            self.stats["paused_seconds"] += paused_s
            self.pass_seconds.observe(seconds)
        finished = self.outputs.record(chunks, batch, logits, draws)
        if any(chunk.draft for chunk in chunks):
            self._walk_drafts(chunks, batch, logits, finished)
        with self._scheduling():
            self.scheduler.finish([request for request, _ in finished])
        self.outputs.deliver(finished)

    def _rows_to_sample(self, chunks: list[Chunk], batch: PackedBatch) -> list[tuple[Request, int]]:
        """The logits row each request draws its next token from: every chunk that reached its
        request's last known token — and, at the first token of an n > 1 request, each of its other
        samples the scheduler forks from that prefill now (their KV blocks copied by the runner),
        so they draw from the same row."""
        plan = [(c.request, batch.logits_rows[i][0]) for i, c in enumerate(chunks) if c.needs_logits]
        leaders = [(request, row) for request, row in plan if request.siblings]
        for leader, row in leaders:
            with self._scheduling():
                forked, copies = self.scheduler.fork(leader)
            self.runner.copy_blocks(copies)
            plan += [(sibling, row) for sibling in forked]
        return plan

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
        drawn_ahead = {(id(draw.request), draw.row): draw for draw in self.sampler.sample(
            [(chunk.request, first + depth) for chunk, first in ahead for depth in range(1, len(chunk.draft) + 1)],
            logits)}
        depth = 0
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
            draws = iter(self.sampler.sample([plan for plan, draw in zip(rows, ready) if draw is None], logits))
            before = len(finished)
            for draw in ready:
                self.outputs.take(draw if draw is not None else next(draws), logits, finished)
            ended.update(id(request) for request, _ in finished[before:])
            walking = [(chunk, first) for chunk, first in walking if depth < len(chunk.draft)]
        with self.cond:
            self.scheduler.drafted(chunks, taken, ended)

    def _defer(self, request: Request) -> bool:
        return request.follow_up and self.arrivals.defers(request.queued_at)

    def _in_slices(self, plan: Plan) -> int:
        """One pass of `plan`, paused between slices of layers while others wait (module docstring)."""
        runner, chunks = self.runner, plan.chunks
        planned = self.scheduler.planned
        in_flight = frozenset(id(chunk.request) for chunk in chunks)
        layers = runner.num_layers
        assert layers is not None
        pauses, computing, paused_s, started = 0, 0.0, 0.0, time.perf_counter()
        try:
            batch = runner.prepare(plan)
            state = runner.begin(batch, plan.resident)
            work = SliceWork(batch.past_lens, batch.cu_seqlens_list)
            per_slice = self.slice_rows(planned, layers, work)
            while state.next_layer < layers:
                sliced, before = time.perf_counter(), state.rows_done
                runner.advance(state, per_slice)
                took, between, done = time.perf_counter() - sliced, 0.0, state.rows_done - before
                if done >= MIN_SLICE_ROWS:  # a prompt's pace (a decode pass's few rows are mostly fixed costs)
                    self.pace.observe(done, work.keys_between(before, state.rows_done), took)
                if state.next_layer < layers and self._others_wait(in_flight):
                    paused = time.perf_counter()
                    computing += paused - started
                    if self._between(in_flight):
                        pauses += 1
                        between = time.perf_counter() - paused
                        paused_s += between
                        self.betweens.append(between)
                    started = time.perf_counter()
                per_slice = self.resize(work, state.rows_done, done, took, max(self.betweens, default=between))
            logits = runner.end(state)  # [K, vocab]
        finally:
            self._ended()
        computing += time.perf_counter() - started
        self._record(chunks, batch, logits, computing, planned, pauses, paused_s)
        return batch.num_tokens

    def _others_wait(self, in_flight: frozenset[int]) -> bool:
        """Whether anything outside a paused pass is queued or running."""
        with self.cond:
            return self.scheduler.has_other_work(in_flight)

    def slice_rows(self, planned: tuple[float, float], layers: int, work: SliceWork) -> int:
        """A pass's first slice, in rows of layers (a whole layer is `work.rows` of them): at the
        pace of the last slices run (`SlicePace`), the rows predicted within the target less the
        most a pass between may take (BETWEEN_SHARE); else as many as the pass target holds by the
        cost model's prediction of the whole pass (one layer before it has timed a pass); at
        least MIN_SLICE_ROWS."""
        least = min(MIN_SLICE_ROWS, work.rows)
        target = self.scheduler.pass_time_s
        if self.pace.ready:  # the clock, not the fit
            return max(least, self.pace.rows_within(work, 0, target * (1 - BETWEEN_SHARE), layers * work.rows))
        seconds = self.scheduler.predict(*planned)
        if seconds is None or seconds <= 0:
            return work.rows
        return max(least, int(layers * work.rows * target / seconds))

    def resize(self, work: SliceWork, rows_done: int, rows: int, seconds: float, between: float) -> int:
        """The next slice's rows, after the first `rows_done`; the last one's `rows` took `seconds`,
        and a pass between two slices takes `between` (the longest of the last few; 0: none ran).
        A running answer waits a slice and a pass between two tokens, so a slice aims at the
        target less that pass (at least LEAST_SLICE of it): the rows the pace of the last slices
        predicts within it (rows late in a long prompt's layer cost more than its first:
        `SliceWork`), else in the last slice's proportion. At most twice the last slice's rows,
        never under MIN_SLICE_ROWS."""
        least = min(MIN_SLICE_ROWS, work.rows)
        target = max(self.scheduler.pass_time_s * LEAST_SLICE, self.scheduler.pass_time_s - between)
        if self.pace.ready:
            target *= SLICE_AIM
            return max(least, self.pace.rows_within(work, rows_done, target, 2 * rows))
        if seconds <= 0:
            return rows
        return max(least, min(2 * rows, int(rows * target / seconds)))

    def _between(self, in_flight: frozenset[int]) -> bool:
        """One ordinary pass for what waits beside a paused pass; whether one ran. The paused
        pass's blocks under way are hidden from it (`BlockManager.swap_filling`)."""
        with self.cond:
            paused = self.scheduler.swap_filling({})
        try:
            plan = self._plan(in_flight, share=BETWEEN_SHARE)
            return bool(plan.chunks) and self._whole(plan) > 0
        finally:
            with self.cond:
                self.scheduler.swap_filling(paused)

    def emptied(self) -> bool:
        """Whether the last pass left the engine with nothing queued or running, decided when its
        requests were freed, before their callers heard (called under the engine's lock). A caller
        answered by it may submit again before the worker looks for work: that request still finds
        an idle engine, and its first pass waits for those arriving with it (`arrivals`)."""
        return self.scheduler.emptied

    def fail_pass(self, exc: BaseException) -> None:
        """A pass raised: its running requests fail, each with its own error chained to the cause;
        the worker goes on."""
        with self._scheduling():
            failed = self.scheduler.fail_running()
        errors: Finished = []
        for request in failed:
            error = PassFailedError(f"the forward pass this request was in failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            errors.append((request, error))
        self.outputs.deliver(errors)

    def drain(self) -> None:
        """Closing (under the engine's lock): every request still queued or running fails with
        `EngineClosedError`."""
        pending = self.scheduler.drain()
        self.cond.notify_all()
        self.outputs.deliver([(request, EngineClosedError("the engine was closed before this request finished"))
                              for request in pending])
