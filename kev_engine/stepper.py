"""One pass of the engine, in stage order: what the worker thread drives.

    cancel → schedule → pack → forward → fork n > 1 samples → sample → record → finish

Where this sits: `Engine` composes the components and hands the worker (`core/worker.py`) this
`Stepper`, a narrow view of them — whether there is work, one step, failing the requests of a
pass that raised, draining on close. The worker holds it only weakly (an engine dropped without
`close()` is collected, and its thread ends), and neither calls back into the `Engine`.

A pass that pauses: with a time target and Kev's own model, a batch is one pass whatever its size
(`Scheduler.schedule(whole=True)`), and its forward runs in slices, each about one target long by
the cost model's prediction: whole layers, or where one layer alone takes longer (a prompt of
thousands of tokens), the next rows of a layer (`DecoderModel.advance`). Between two slices, while
anything else is queued or answering, one ordinary pass runs for it (the running answers' next
tokens, newly arrived questions; nothing of the paused pass, whose blocks under way it cannot
see), then the paused pass resumes. Alone on the engine it runs to its end. Its rows are the same
bits either way: the kernels are batch-invariant, and between its slices it holds only its hidden
states.
"""

from __future__ import annotations

import math
import time

from .core.arrivals import Arrivals
from .core.lifecycle import Lifecycle
from .core.request import Request
from .core.schedule import Chunk, Scheduler
from .model.runner import ModelRunner

MIN_SLICE_ROWS = 64  # a slice's least rows of a layer: fewer would cost more in calls than they save
BETWEEN_SHARE = 0.5  # of the pass target, what a pass between two slices may take (a prompt that came
# meanwhile goes on in chunks there): a running answer waits a slice and that pass between two tokens


class Stepper:
    def __init__(self, life: Lifecycle, runner: ModelRunner, scheduler: Scheduler, arrivals: Arrivals) -> None:
        self.life = life
        self.runner = runner
        self.scheduler = scheduler
        self.arrivals = arrivals
        self.closed = False  # set by `Engine.close` (or at interpreter exit): the worker drains and ends
        self.row_seconds: float | None = None  # the last slice's seconds per row of a layer

    def has_work(self) -> bool:
        """Anything queued or running (called under the engine's lock)."""
        return self.scheduler.has_work()

    def step(self) -> int:
        """One pass; the number of tokens it ran (0: nothing could run). The caller holds the
        worker's pass lock (`Worker.run_pass`), never the engine's: each stage takes it itself."""
        life = self.life
        life.cancel()
        whole = self.runner.num_layers is not None and math.isfinite(self.scheduler.pass_time_s)
        chunks = life.schedule(self._defer, whole=whole)
        if not chunks:
            return 0
        return self._in_slices(chunks) if whole else self._whole(chunks)

    def _whole(self, chunks: list[Chunk]) -> int:
        """One pass of `chunks`, start to end; the tokens it ran."""
        life = self.life
        started = time.perf_counter()
        try:
            batch = self.runner.pack(chunks)
            logits = self.runner.forward(batch, life.resident_adapters())  # [K, vocab]
        finally:
            life.end_pass()
        draws = life.sample(life.rows_to_sample(chunks, batch), logits)
        life.finish(life.record(chunks, batch, logits, draws, time.perf_counter() - started))
        return batch.num_tokens

    def _defer(self, request: Request) -> bool:
        return request.follow_up and self.arrivals.defers(request.queued_at)

    def _in_slices(self, chunks: list[Chunk]) -> int:
        """One pass of `chunks`, paused between slices of layers while others wait (module docstring)."""
        life, runner = self.life, self.runner
        planned = self.scheduler.planned
        in_flight = frozenset(id(chunk.request) for chunk in chunks)
        layers = runner.num_layers
        assert layers is not None
        pauses, computing, paused_s, started = 0, 0.0, 0.0, time.perf_counter()
        try:
            batch = runner.pack(chunks)
            state = runner.begin(batch, life.resident_adapters())
            per_slice = self.slice_rows(planned, layers, state.num_rows)
            while state.next_layer < layers:
                sliced, before = time.perf_counter(), state.rows_done
                runner.advance(state, per_slice)
                took, between, done = time.perf_counter() - sliced, 0.0, state.rows_done - before
                if done >= MIN_SLICE_ROWS:  # a prompt's pace (a decode pass's few rows are mostly fixed costs)
                    self.row_seconds = took / done
                if state.next_layer < layers and life.others_wait(in_flight):
                    paused = time.perf_counter()
                    computing += paused - started
                    if self._between(in_flight):
                        pauses += 1
                        between = time.perf_counter() - paused
                        paused_s += between
                    started = time.perf_counter()
                per_slice = self.resize(done, took, between, state.num_rows)
            logits = runner.end(state)  # [K, vocab]
        finally:
            life.end_pass()
        draws = life.sample(life.rows_to_sample(chunks, batch), logits)
        computing += time.perf_counter() - started
        life.finish(life.record(chunks, batch, logits, draws, computing, planned, pauses, paused_s))
        return batch.num_tokens

    def slice_rows(self, planned: tuple[float, float], layers: int, rows: int) -> int:
        """A pass's first slice, in rows of layers (a whole layer is `rows` of them): at the pace of
        the last slice run (half a target's worth: it may have been a shorter context's), else as
        many as the pass target holds by the cost model's prediction of the whole pass (one layer
        before it has timed a pass); at least MIN_SLICE_ROWS."""
        least = min(MIN_SLICE_ROWS, rows)
        if self.row_seconds is not None:  # the last slice's pace, where one ran: the clock, not the fit
            return max(least, int(self.scheduler.pass_time_s * BETWEEN_SHARE / self.row_seconds))
        seconds = self.scheduler.predict(*planned)
        if seconds is None or seconds <= 0:
            return rows
        return max(least, int(layers * rows * self.scheduler.pass_time_s / seconds))

    def resize(self, rows: int, seconds: float, between: float, total: int) -> int:
        """The next slice's rows, from the last one's: `rows` took `seconds`, and the pass run
        after it `between` (0: none ran). A running answer waits a slice and a pass between two tokens, so a
        slice aims at the target less that pass (at least half the target); the prediction the
        first slice was sized by may be far off (a long prompt's attention), the clock is not.
        At most twice the last slice, never under MIN_SLICE_ROWS."""
        if seconds <= 0:
            return rows
        target = max(self.scheduler.pass_time_s / 2, self.scheduler.pass_time_s - between)
        return max(min(MIN_SLICE_ROWS, total), min(2 * rows, int(rows * target / seconds)))

    def _between(self, in_flight: frozenset[int]) -> bool:
        """One ordinary pass for what waits beside a paused pass; whether one ran."""
        life = self.life
        with life.between_slices():
            life.cancel(in_flight)
            chunks = life.schedule(self._defer, in_flight=in_flight, share=BETWEEN_SHARE)
            return bool(chunks) and self._whole(chunks) > 0

    def emptied(self) -> bool:
        """Whether the last pass left the engine with nothing queued or running, decided when its
        requests were freed, before their callers heard (called under the engine's lock). A caller
        answered by it may submit again before the worker looks for work: that request still finds
        an idle engine, and its first pass waits for those arriving with it (`arrivals`)."""
        return self.life.emptied

    def fail_pass(self, exc: BaseException) -> None:
        """A pass raised: its running requests fail with it; the worker goes on."""
        self.life.fail_running(exc)

    def drain(self) -> None:
        """Closing: every request still queued or running fails with `EngineClosedError`."""
        self.life.drain()
