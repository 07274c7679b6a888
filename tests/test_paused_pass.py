"""A pass that pauses between its layers: a batch is one pass whatever its size, and while it runs
the running answers and newly arrived questions go on between its slices (kev_engine/stepper.py).

No clock decides anything here: the cost model is given (1 ms a token), and each slice's layers
follow from its prediction; the engine is stepped by hand (`hold()` keeps its worker out), or a
background answer keeps others waiting while the worker runs a batch."""

from __future__ import annotations

import math
import random
import threading
from typing import Any

import pytest
import torch
from conftest import QUESTIONS, chat, make_adapter, tiny_model
from test_invariance import alone, answers, differences, greedy, questions
from test_pass_budget import per_token

from kev_engine import Engine, SamplingParams
from kev_engine.core.slice_work import SlicePace, SliceWork
from kev_engine.models.llama import PassState
from kev_integrations.server.metrics import Metrics

LAYERS = 6
TARGET_MS = 200
DOCUMENT = "The lighthouse keeper logged every ship that passed the granite point. " * 40


def paused_engine(tokenizer: Any, dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs: Any) -> Engine:
    """Kev's model of LAYERS layers, a 200 ms target and 1 ms a token: a pass of a thousand tokens
    is five targets, and a short question fits the half of one that a pass between slices takes."""
    model = tiny_model("llama", tokenizer, seed=seed, num_hidden_layers=LAYERS).to(dtype)
    engine = Engine(model, tokenizer, pass_time_ms=TARGET_MS, **kwargs)
    engine._scheduler.cost = per_token(1.0)
    return engine


def whole_engine(tokenizer: Any, dtype: torch.dtype = torch.float32, seed: int = 0) -> Engine:
    """The same weights, passes bounded by tokens alone: nothing ever pauses."""
    model = tiny_model("llama", tokenizer, seed=seed, num_hidden_layers=LAYERS).to(dtype)
    return Engine(model, tokenizer, pass_time_ms=math.inf)


def spy_slices(engine: Engine, monkeypatch: pytest.MonkeyPatch, before: Any = None) -> list[tuple[int, int]]:
    """(the layer a slice starts at, tokens generated so far) for each slice the engine runs;
    `before(state)` runs first, on the pass's thread."""
    seen: list[tuple[int, int]] = []
    advance = engine._runner.advance

    def spy(state: PassState, rows: int) -> None:
        seen.append((state.next_layer, engine.stats()["generated_tokens"]))
        if before is not None:
            before(state)
        advance(state, rows)

    monkeypatch.setattr(engine._runner, "advance", spy)
    return seen


def by_layers(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of one whole layer each (the cost model and the clock would cut these passes into rows)."""
    monkeypatch.setattr(engine._stepper, "slice_rows", lambda planned, layers, work: work.rows)
    monkeypatch.setattr(engine._stepper, "resize", lambda work, rows_done, rows, seconds, between: work.rows)


def answering(engine: Engine) -> Any:
    """A long answer that has started decoding: while it runs, a batch's pass has someone to pause
    for (submitted together, it would be in that pass)."""
    started = threading.Event()
    future = engine.submit(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=800, ignore_eos=True),
                           on_text=lambda piece: started.set())
    assert started.wait(120)
    return future


def long_prompts(count: int, shared: bool = True) -> list[Any]:
    """Questions on one long log (`shared`: computed once, by the first), or each on its own."""
    return [chat(f"Question {i}: which ship came {i + 1}th?", ("" if shared else f"Log {i}. ") + DOCUMENT)
            for i in range(count)]


def test_a_batch_alone_is_one_pass_whatever_its_size(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with paused_engine(tokenizer) as engine:
        prompts = long_prompts(3, shared=False)
        monkeypatch.setattr(engine._stepper, "resize", lambda work, done, rows, seconds, between: rows)  # no clock
        seen = spy_slices(engine, monkeypatch)
        with engine.hold():  # nothing else runs: the worker waits, this thread steps
            futures = engine.submit_many(prompts, SamplingParams(temperature=0, max_tokens=2))
            tokens = engine.step()
            stats = engine.stats()
            # every prompt whole: five targets' work, one pass, with nobody to pause for
            assert tokens == sum(len(engine.encode(p)) for p in prompts) - stats["prefix_hit_tokens"] > 5 * TARGET_MS
            assert stats["prefill_passes"] == 1 and stats["pass_slices"] == 0
            # slices of the target's share of the pass's rows of layers: TARGET_MS of `tokens` ms, LAYERS layers
            per_slice = LAYERS * tokens * TARGET_MS // tokens
            assert len(seen) == math.ceil(LAYERS * tokens / per_slice)
            stepper = engine._stepper
            assert stepper.pace.ready  # the pace of the slices run, for the next pass's first
            stepper.pace = SlicePace()
            uniform = SliceWork([0], [0, tokens])
            assert stepper.slice_rows((float(tokens), 0.0), LAYERS, uniform) == per_slice < tokens
            stepper.pace.observe(100, 0, 0.1)  # 1 ms a row of a layer: half a target's rows
            assert stepper.slice_rows((float(tokens), 0.0), LAYERS, uniform) == TARGET_MS // 2
        assert all(f.result(timeout=60).completion_tokens == 2 for f in futures)


def test_a_question_that_arrives_starts_before_the_batch_resumes_and_answers_decode_every_slice(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with paused_engine(tokenizer) as engine:
        arrived: list[Any] = []

        def arrive(state: PassState) -> None:
            if state.next_layer == 1:  # while the batch is under way
                arrived.append(engine.submit(QUESTIONS[3], SamplingParams(temperature=0, max_tokens=1)))

        with engine.hold():
            running = engine.submit(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
            engine.step()  # its prompt: it answers from now on
            big = engine.submit_many(long_prompts(2), SamplingParams(temperature=0, max_tokens=2))
            by_layers(engine, monkeypatch)
            seen = spy_slices(engine, monkeypatch, arrive)
            hits = engine.stats()["prefix_hit_tokens"]
            whole = sum(len(engine.encode(p)) for p in long_prompts(2))
            assert engine.step() == whole - (engine.stats()["prefix_hit_tokens"] - hits)  # the batch, whole
            generated = [tokens for _, tokens in seen]
            assert [layer for layer, _ in seen] == list(range(LAYERS))
            # the running answer's token in every pause; the new question's first (and only) token
            # in the pause right after it arrived, before the batch's next slice
            assert [b - a for a, b in zip(generated, generated[1:])] == [1, 2, 1, 1, 1]
            assert engine.stats()["pass_slices"] == LAYERS - 1 and engine.stats()["paused_seconds"] > 0
            assert "kev_pass_pauses_total 5.0\n" in Metrics().render(engine.stats()).decode()
        assert arrived[0].result(timeout=60).completion_tokens == 1
        running.cancel()
        assert all(f.result(timeout=60).completion_tokens == 2 for f in big)


def test_a_question_asked_beside_a_long_batch_starts_between_its_slices(tokenizer: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers at the same moment, a long batch and one short question: the pass holds the
    batch, whole; the other caller's question, which the pass could not hold within its target,
    has its answer after the batch's first slice."""
    with paused_engine(tokenizer) as engine:
        with engine.hold():
            big = engine.submit_many(long_prompts(2, shared=False), SamplingParams(temperature=0, max_tokens=2))
            quick = engine.submit(QUESTIONS[3], SamplingParams(temperature=0, max_tokens=1))
            by_layers(engine, monkeypatch)
            seen = spy_slices(engine, monkeypatch)
            assert engine.step() == sum(len(engine.encode(p)) for p in long_prompts(2, shared=False))
            assert [tokens for _, tokens in seen][:2] == [0, 1]  # the short question's token, after slice one
            assert engine.stats()["pass_slices"] == 1  # then nobody else waited
        assert quick.result(timeout=60).completion_tokens == 1
        assert all(f.result(timeout=60).completion_tokens == 2 for f in big)


@pytest.mark.parametrize("with_adapters", [False, True], ids=["rows", "adapters"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_equals_alone_bitwise_with_pauses_at_random_slices(
        dtype: torch.dtype, with_adapters: bool, tokenizer: Any, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Any) -> None:
    """A batch on a shared document, with a grammar, a seeded sample and n = 2 (and LoRA adapters,
    whose passes move by whole layers; without them, slices end inside layers too), paused at
    random slices while a background answer decodes between them: every question bitwise as alone."""
    engine = paused_engine(tokenizer, dtype)
    whole = whole_engine(tokenizer, dtype)
    try:
        adapters = [None] * 6
        if with_adapters:
            folder = make_adapter(tiny_model("llama", tokenizer, num_hidden_layers=LAYERS), tmp_path / "qv", seed=1)
            for e in (engine, whole):
                e.load_adapter("qv", str(folder))
            adapters = ["qv", None, "qv", None, None, "qv"]
        rng = random.Random(5)
        monkeypatch.setattr(engine._stepper, "slice_rows",
                            lambda planned, layers, work: rng.randint(max(1, work.rows // 6), 2 * work.rows))
        monkeypatch.setattr(engine._stepper, "resize",
                            lambda work, *_: rng.randint(max(1, work.rows // 6), 2 * work.rows))
        inside: list[int] = []
        spy_slices(engine, monkeypatch, lambda state: state.next_row and inside.append(state.next_row))
        prompts = questions(2, 6, document_words=150)
        sampling = greedy(6, 6)
        sampling[1] = SamplingParams(temperature=0, max_tokens=6, regex="[a-z ]{1,12}")
        sampling[2] = SamplingParams(temperature=0.8, seed=7, max_tokens=5)
        background = answering(engine)
        packed = answers(engine, prompts, sampling, adapters)
        assert engine.stats()["pass_slices"] > 0 and engine.stats()["prefix_hit_tokens"] > 0
        assert inside or with_adapters  # slices that began inside a layer (a pass with adapter rows has none)
        samples = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=5)  # n = 2: the tokens (no logits kept)
        two = [c.token_ids for c in engine.submit(prompts[0], samples).result(timeout=120).samples]
        slices = engine.stats()["pass_slices"]
        background.cancel()
        solo = alone(whole, prompts, sampling, adapters)
        assert differences(packed, solo) == []
        alone_two = whole.submit(prompts[0], samples).result(timeout=120).samples
        assert slices > 0 and two == [c.token_ids for c in alone_two]
    finally:
        engine.close()
        whole.close()


def test_a_request_cancelled_in_a_paused_pass_is_freed_after_it(tokenizer: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with paused_engine(tokenizer) as engine:
        with engine.hold():
            running = engine.submit(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
            engine.step()
            big = engine.submit_many(long_prompts(3), SamplingParams(temperature=0, max_tokens=2))
            by_layers(engine, monkeypatch)
            spy_slices(engine, monkeypatch, lambda state: state.next_layer == 2 and big[1].cancel())
            engine.step()  # its blocks stay its own until the pass is over: the pass still writes them
            assert engine.stats()["cancelled"] == 0
            running.cancel()
            while engine.has_work():
                engine.step()
        stats = engine.stats()
        assert stats["cancelled"] == 2 and stats["running"] == stats["waiting"] == 0
        assert stats["kv_cache_bytes"] == 0  # every block given back
        assert [big[i].result(timeout=60).completion_tokens for i in (0, 2)] == [2, 2]


def test_control_a_pause_that_loses_the_pass_state_changes_the_answer(tokenizer: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The bitwise comparison above can fail: a resume that starts from the hidden states of the
    slice before (one slice's work lost) changes the logits."""
    engine = paused_engine(tokenizer)
    whole = whole_engine(tokenizer)
    try:
        previous: dict[str, torch.Tensor] = {}

        def lose_a_slice(state: PassState) -> None:
            if state.next_layer == 3:
                state.hidden = previous["hidden"]  # what the pass held before layer 2
            previous["hidden"] = state.hidden.clone()

        background = answering(engine)
        by_layers(engine, monkeypatch)
        spy_slices(engine, monkeypatch, lose_a_slice)
        prompts = questions(3, 3, document_words=150)
        packed = answers(engine, prompts, greedy(3, 4))
        background.cancel()
        assert engine.stats()["pass_slices"] > 0
        assert differences(packed, alone(whole, prompts, greedy(3, 4))) != []
    finally:
        engine.close()
        whole.close()


def test_a_slice_follows_the_clock_within_bounds(tokenizer: Any) -> None:
    """After a pause the next slice is sized by how long the last ones took, aiming at the target
    less the pass run between (at least LEAST_SLICE of it), at most twice the last, at least
    MIN_SLICE_ROWS: before any slice was timed, in the last one's proportion."""
    from kev_engine.stepper import LEAST_SLICE, MIN_SLICE_ROWS, SLICE_AIM

    with paused_engine(tokenizer) as engine:  # a 200 ms target
        stepper = engine._stepper
        stepper.pace = SlicePace()  # nothing timed yet: the last slice's proportion
        alike = SliceWork([0], [0, 5000])
        assert stepper.resize(alike, 1000, 1000, 0.4, 0.0) == 500  # twice the target: half the rows
        assert stepper.resize(alike, 1000, 1000, 0.4, 0.04) == 400  # the target less the pass between
        assert stepper.resize(alike, 1000, 1000, 0.4, 0.19) == int(1000 * LEAST_SLICE / 2)  # never under that
        assert stepper.resize(alike, 1000, 1000, 0.001, 0.0) == 2000  # at most twice the last
        assert stepper.resize(alike, 1000, 1000, 100.0, 0.0) == MIN_SLICE_ROWS
        assert stepper.resize(SliceWork([0], [0, 10]), 10, 10, 100.0, 0.0) == 10  # fewer rows than that: its rows
        # timed slices: 1 ms a row and 0.1 us a key, exactly; the next slice holds the rows predicted
        # within SLICE_AIM of the target, fewer late in a long prompt's layer than early
        prompt = SliceWork([0], [0, 5000])
        for start, rows in ((0, 1000), (1000, 1000), (2000, 500)):
            stepper.pace.observe(rows, prompt.keys_between(start, start + rows),
                                 0.001 * rows + 1e-7 * prompt.keys_between(start, start + rows))
        early, late = stepper.resize(prompt, 100, 100, 0.1, 0.0), stepper.resize(prompt, 4000, 100, 0.1, 0.0)
        budget = 0.2 * SLICE_AIM
        for done, rows in ((100, early), (4000, late)):
            def seconds(count: int, done: int = done) -> float:
                return 0.001 * count + 1e-7 * prompt.keys_between(done, done + count)
            assert seconds(rows) <= budget < seconds(rows + 1)
        assert late < early <= 200  # at most twice the last slice's 100 rows


def test_the_pace_is_fitted_to_rows_and_keys_and_its_margin_to_the_slowest_slice() -> None:
    pace = SlicePace()
    work = SliceWork([0, 100], [0, 300, 500])  # two segments: the second after 100 cached tokens
    assert work.keys(300) == sum(range(1, 301)) and work.keys(301) == work.keys(300) + 101
    assert work.keys(500 + 2) == work.layer_keys + 1 + 2  # the next layer starts again at its first rows
    for rows, keys in ((100, 5_000), (100, 25_000), (200, 10_000)):
        pace.observe(rows, keys, 0.002 * rows + 4e-6 * keys)
    per_row, per_key = pace.rates()
    assert per_row == pytest.approx(0.002) and per_key == pytest.approx(4e-6)
    assert pace.margin(per_row, per_key) == pytest.approx(1.0)
    pace.observe(100, 5_000, 2 * (0.002 * 100 + 4e-6 * 5_000))  # a slice the machine stretched twice over
    assert pace.margin(*pace.rates()) > 1.5  # the next slices aim that much under their time
    # control: rows alone (rows and keys in one proportion) put the whole time on the rows
    alone = SlicePace()
    alone.observe(100, 1_000, 0.1)
    assert alone.rates() == (pytest.approx(0.001), 0.0)


def test_the_fallback_cannot_pause_and_cuts_a_batch_into_passes(tokenizer: Any) -> None:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, pass_time_ms=50, model_impl="transformers")
    engine._scheduler.cost = per_token(1.0)
    try:
        assert engine._runner.num_layers is None
        with engine.hold():
            engine.submit_many(long_prompts(2), SamplingParams(temperature=0, max_tokens=1))
            assert engine.step() == 100  # ALONE_FACTOR targets of 1 ms tokens
    finally:
        engine.close()
