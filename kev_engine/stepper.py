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


class Stepper:
    def __init__(self, life: Lifecycle, runner: ModelRunner, scheduler: Scheduler, arrivals: Arrivals) -> None:
        self.life = life
        self.runner = runner
        self.scheduler = scheduler
        self.arrivals = arrivals
        self.closed = False  # set by `Engine.close` (or at interpreter exit): the worker drains and ends

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
                runner.advance(state, per_slice)
                if state.next_layer < layers and life.others_wait(in_flight):
                    paused = time.perf_counter()
                    computing += paused - started
                    if self._between(in_flight):
                        pauses += 1
                        paused_s += time.perf_counter() - paused
                    started = time.perf_counter()
            logits = runner.end(state)  # [K, vocab]
        finally:
            life.end_pass()
        draws = life.sample(life.rows_to_sample(chunks, batch), logits)
        computing += time.perf_counter() - started
        life.finish(life.record(chunks, batch, logits, draws, computing, planned, pauses, paused_s))
        return batch.num_tokens

    def slice_rows(self, planned: tuple[float, float], layers: int, rows: int) -> int:
        """Rows of layers per slice (a whole layer is `rows` of them): as many as the pass target
        holds by the cost model's prediction of the whole pass, at least MIN_SLICE_ROWS (one layer
        before it has timed a pass)."""
        seconds = self.scheduler.predict(*planned)
        if seconds is None or seconds <= 0:
            return rows
        return max(min(MIN_SLICE_ROWS, rows), int(layers * rows * self.scheduler.pass_time_s / seconds))

    def _between(self, in_flight: frozenset[int]) -> bool:
        """One ordinary pass for what waits beside a paused pass; whether one ran."""
        life = self.life
        with life.between_slices():
            life.cancel(in_flight)
            chunks = life.schedule(self._defer, in_flight=in_flight)
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
