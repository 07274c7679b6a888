"""A draft model: a smaller model with the same tokenizer writes each decoding question's next
tokens, and the packed pass verifies them (`core.drafts`, `Stepper._walk_drafts`).

Where this sits: the stepper asks it to `prepare` drafts before each pass is planned, outside the
engine's lock; the scheduler then prices each draft's rows as it prices prompt-lookup drafts, and
the walk takes what plain decoding would have drawn. The drafts change which rows a pass holds,
never a token: the target model's rows are the same bits however many ride beside them.

The draft model is a Kev engine of its own (its own KV pool and prefix cache: a question's tokens
are cached there from one draft to the next, so each draft computes only the tokens since the
last). Its passes run here, on the target engine's pass thread, by hand (`Engine.hold` and
`Engine.step`): one thread computes at a time, and the draft engine's worker never wakes.

Drafting costs passes of the draft model before every pass of the target, whatever is taken, so
it is turned down where it does not pay: the seconds spent drafting are weighed against the
target passes the taken tokens saved (each taken token saves a decode pass of one question, a
share of a pass of many), over a window that forgets; where drafting costs more, only every
PROBE_EVERY-th pass drafts, to learn whether that has changed. A draft model that raises (closed
under the engine, say) is warned of and drafts no more: drafts are optional, answers go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .core.drafts import ModelDrafter
from .core.request import Request
from .inputs.params import SamplingParams
from .results import Completion

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("kev")

WARMUP_DRAFTS = 8  # drafting passes before the draft model is judged on what it saved
PROBE_EVERY = 16  # where drafting does not pay, one pass in this many still drafts (to learn)
FORGET = 0.95  # each pass, what the earlier seconds spent and saved still weigh


class DraftModel:
    """A second engine that writes drafts greedily; `saved_per_token(rows)` prices what a taken
    draft token saves in a pass of `rows` decoding questions (the target's decode pass seconds
    over its rows, `Scheduler.decode_row_seconds`; None before the target has timed one)."""

    def __init__(self, engine: Engine, owned: bool, target_tokenizer: Any, vocab_rows: int) -> None:
        check_same_tokenizer(engine.tokenizer, target_tokenizer, engine.name)
        self.engine = engine
        self.owned = owned  # built by the target engine from a name: closed with it
        self.vocab_rows = vocab_rows  # the target's embedding rows: a draft token past them is never offered
        self.saved_per_token: Callable[[int], float | None] = lambda rows: None  # the target's scheduler sets it
        self.spent_s = 0.0  # drafting seconds, forgetting (FORGET)
        self.saved_s = 0.0  # target seconds the taken draft tokens saved, forgetting alike
        self.seconds = 0.0  # all drafting seconds: a stat
        self.passes = 0  # target passes prepared for
        self.drafting = 0  # of those, the ones that drafted
        self._pending: list[tuple[ModelDrafter, int, int]] = []  # the last drafts: (drafter, taken before, rows)
        self.failed: str | None = None  # the draft engine raised: why (no more drafts)

    @property
    def name(self) -> str:
        return self.engine.name

    def prepare(self, wanted: Sequence[tuple[Request, list[int], int]]) -> None:
        """Write a draft for each (request, its tokens, the most draft tokens) — one packed
        `generate` of the draft engine, greedy — unless drafting has not paid lately."""
        self._learn()
        self.passes += 1
        if not wanted or self.failed is not None or not self._pays():
            return
        started = time.perf_counter()
        try:
            futures = self._generate(wanted)
        except Exception as exc:  # noqa: BLE001 - drafts are optional: the answers go on without them
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("Kev: the draft model %r failed (%s); this engine drafts no more, its answers are the same",
                        self.name, self.failed)
            return
        self._pending = []
        for (request, ids, _), future in zip(wanted, futures):
            drafter = request.drafter
            assert isinstance(drafter, ModelDrafter)
            drafter.ready = (len(ids), self._draft(future))
            self._pending.append((drafter, drafter.taken_tokens, len(wanted)))
        took = time.perf_counter() - started
        self.seconds += took
        self.spent_s += took
        self.drafting += 1

    def _generate(self, wanted: Sequence[tuple[Request, list[int], int]]) -> list[Future[Completion]]:
        """The draft engine's greedy answers, its passes run here (`hold`, `step`)."""
        engine = self.engine
        prompts = [{"prompt_token_ids": ids} for _, ids, _ in wanted]
        sampling = [SamplingParams(temperature=0, max_tokens=limit) for _, _, limit in wanted]
        with engine.hold():
            futures = engine.submit_many(prompts, sampling)
            while engine.has_work():
                if engine.step() == 0:  # nothing could run (its KV pool is full): these drafts are given up
                    for future in futures:
                        future.cancel()
                    engine.step()  # the cancelled leave
                    break
        return futures

    def _draft(self, future: Future[Completion]) -> list[int]:
        """A draft's tokens, up to the first the target model has no row for; none where the draft
        model could not write it (a question too long for its context, say)."""
        if future.cancelled() or future.exception() is not None:
            log.debug("Kev: the draft model wrote no draft for a question: %s",
                      "cancelled" if future.cancelled() else future.exception())
            return []
        draft = future.result().token_ids
        return draft[:next((i for i, token in enumerate(draft) if token >= self.vocab_rows), len(draft))]

    def _learn(self) -> None:
        """What the last drafts saved: their taken tokens, each a decode row's share of its pass."""
        for drafter, before, rows in self._pending:
            per_token = self.saved_per_token(rows)
            if per_token is not None:
                self.saved_s += (drafter.taken_tokens - before) * per_token
        self._pending = []
        self.spent_s *= FORGET
        self.saved_s *= FORGET

    def _pays(self) -> bool:
        if self.drafting < WARMUP_DRAFTS or self.saved_s >= self.spent_s:
            return True
        return self.passes % PROBE_EVERY == 0

    def close(self) -> None:
        if self.owned:
            self.engine.close()


def check_same_tokenizer(draft: Any, target: Any, draft_name: str) -> None:
    """Refuse a draft model whose tokenizer maps any token differently: its token ids would be
    another text's in the target model."""
    if draft is target:
        return
    ours, theirs = target.get_vocab(), draft.get_vocab()
    if ours != theirs:
        differing = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
        raise ValueError(f"draft_model {draft_name!r} has another tokenizer ({len(theirs)} tokens against the "
                         f"model's {len(ours)}; e.g. {differing}); a draft model must share the model's tokenizer")


def draft_engine(draft_model: Any, *, dtype: Any, device: Any, threads: int) -> tuple[Engine, bool]:
    """The draft engine and whether the target owns it: a Kev `Engine` as given, else a name
    (a folder, a .gguf file, a hub id) loaded in the target's dtype and device."""
    from .engine import Engine  # the engine builds this; this builds an engine

    if isinstance(draft_model, Engine):
        if draft_model.speculative != "off":
            raise ValueError(f"draft_model {draft_model.name!r} drafts itself (speculative="
                             f"{draft_model.speculative!r}); build it with speculative='off'")
        return draft_model, False
    if not isinstance(draft_model, str):
        raise TypeError(f"draft_model={draft_model!r} is not allowed; give a model's folder, .gguf file or hub id, "
                        "or a Kev Engine")
    try:
        engine = Engine.from_pretrained(draft_model, dtype=dtype, device=device, speculative="off", threads=threads)
    except (OSError, ValueError) as exc:  # said as the draft model's, in the error's own type where it takes a message
        message = f"draft_model={draft_model!r} could not be loaded: {exc}"
        try:
            error = type(exc)(message)
        except TypeError:
            error = ValueError(message)
        raise error from exc
    return engine, True
