"""One pass of the engine, in stage order: what the worker thread drives.

    cancel → schedule → pack → forward → fork n > 1 samples → sample → record → finish

Where this sits: `Engine` composes the components and hands the worker (`core/worker.py`) this
`Stepper`, a narrow view of them — whether there is work, one step, failing the requests of a
pass that raised, draining on close. The worker holds it only weakly (an engine dropped without
`close()` is collected, and its thread ends), and neither calls back into the `Engine`.
"""

from __future__ import annotations

import time

from .core.arrivals import Arrivals
from .core.lifecycle import Lifecycle
from .core.schedule import Scheduler
from .model.runner import ModelRunner


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
        chunks = life.schedule(lambda r: r.follow_up and self.arrivals.defers(r.queued_at))
        if not chunks:
            return 0
        started = time.perf_counter()
        try:
            batch = self.runner.pack(chunks)
            logits = self.runner.forward(batch, life.resident_adapters())  # [K, vocab]
        finally:
            life.end_pass()
        draws = life.sample(life.rows_to_sample(chunks, batch), logits)
        life.finish(life.record(chunks, batch, logits, draws, time.perf_counter() - started))
        return batch.num_tokens

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
