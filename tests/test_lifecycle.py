"""A request's life in the engine when something goes wrong (lifecycle, worker, delivery, model setup).

Callbacks that misbehave, passes that fail, callers that stop early, models shared between
engines, engines dropped without close(). Everything that must share a pass is submitted
under `Engine.hold()` (and stepped by hand where the order matters); every wait is bounded.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import QUESTIONS, chat, make_adapter, reference_copy, tiny_model
from peft import PeftModel

import kev_engine.sample.sample as sample_module
from kev_engine import Engine, EngineClosedError, InvalidRequestError, SamplingParams
from kev_engine.adapters.lora import MultiLoRALinear
from kev_engine.core.delivery import failed_future
from kev_engine.errors import PassFailedError
from kev_engine.sample.sample import apply_top_k_top_p

TIMEOUT = 60  # seconds; a wait that runs out means a hang
ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=8)
DOC = ("The Harbor Museum opened in 1901. It holds 3,000 paintings, most of them seascapes, and a lighthouse "
       "lens from 1874. Its director is Mara Ilves. Admission is free on Sundays. ") * 2
DOC_QUESTIONS = [chat(q, DOC) for q in ("When did it open?", "Who is the director?", "What is free on Sundays?")]


def make_engine(tokenizer: Any, model: torch.nn.Module | None = None, **kwargs: Any) -> Engine:
    kwargs.setdefault("coalesce_ms", 0)
    kwargs.setdefault("kv_cache_bytes", 64 << 20)
    return Engine(model if model is not None else tiny_model("llama", tokenizer), tokenizer, **kwargs)


def close_bounded(engine: Engine) -> None:
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(TIMEOUT)
    assert not closer.is_alive(), "Engine.close() did not return"


def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
    """Run `fn` on a daemon thread (a hang never blocks the test run's exit); wait on the future with a timeout."""
    outcome: Future[Any] = Future()

    def target() -> None:
        try:
            outcome.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting test
            outcome.set_exception(exc)

    threading.Thread(target=target, daemon=True).start()
    return outcome


def count_enqueues(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Semaphore, list[Future]]:
    """Released once per group the engine queues; the list collects every future it hands out."""
    queued = threading.Semaphore(0)
    futures: list[Future] = []
    original = engine._enqueue

    def spy(*args: Any, **kwargs: Any) -> list[Future]:
        out = original(*args, **kwargs)
        futures.extend(out)
        queued.release()
        return out

    monkeypatch.setattr(engine, "_enqueue", spy)
    return queued, futures


@pytest.fixture
def engine(tokenizer: Any) -> Engine:
    engine = make_engine(tokenizer)
    yield engine
    close_bounded(engine)


def solo_tokens(tokenizer: Any, prompts: list[Any], params: SamplingParams) -> list[list[int]]:
    """Each prompt alone, on a fresh engine with the same weights (nothing cached from the test's engine)."""
    solo = make_engine(tokenizer)
    try:
        return [solo.generate([p], params)[0].token_ids for p in prompts]
    finally:
        close_bounded(solo)


# ---- delivery: KeyboardInterrupt / SystemExit in one on_text -------------------------------------


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_base_exception_in_on_text_fails_only_its_request(engine: Engine, tokenizer: Any, error: type) -> None:
    def interrupting(_: str) -> None:
        raise error("the listener stopped")

    with engine.hold():  # one pack: the bad request and the good ones share every pass
        good = [engine.submit(q, GREEDY) for q in QUESTIONS[1:4]]
        bad = engine.submit(QUESTIONS[0], GREEDY, on_text=interrupting)
    assert isinstance(bad.exception(timeout=TIMEOUT), error)
    assert [f.exception(timeout=TIMEOUT) for f in good] == [None] * 3  # never re-raise it in this thread
    answers = [f.result() for f in good]
    assert [a.token_ids for a in answers] == solo_tokens(tokenizer, QUESTIONS[1:4], GREEDY)
    assert engine.generate([QUESTIONS[0]], GREEDY)[0].completion_tokens == 8  # the scheduler thread lives on


# ---- worker: blocking calls from callbacks -------------------------------------------------------


def test_blocking_calls_from_callbacks_are_refused_instead_of_deadlocking(engine: Engine) -> None:
    outcomes: dict[str, BaseException | None] = {}
    calls: dict[str, Callable[[], Any]] = {
        "generate": lambda: engine.generate([QUESTIONS[1]], GREEDY),
        "prompt_logits": lambda: engine.prompt_logits([QUESTIONS[1]]),
        "stream": lambda: next(engine.stream(QUESTIONS[1], GREEDY)),
    }

    def try_all(where: str) -> None:
        for what, call in calls.items():
            if f"{where} {what}" in outcomes:
                continue
            try:
                call()
                outcomes[f"{where} {what}"] = None
            except BaseException as exc:  # noqa: BLE001 - checked below
                outcomes[f"{where} {what}"] = exc

    with engine.hold():
        future = engine.submit(QUESTIONS[0], GREEDY, on_text=lambda _: try_all("on_text"))
        future.add_done_callback(lambda _: try_all("done"))
    assert future.result(timeout=TIMEOUT).completion_tokens == 8
    assert sorted(outcomes) == sorted(f"{w} {c}" for w in ("on_text", "done") for c in calls)
    for where, exc in outcomes.items():
        assert isinstance(exc, InvalidRequestError), f"{where}: {exc!r}"
        assert "engine callback" in str(exc)
    assert engine.generate([QUESTIONS[2]], GREEDY)[0].completion_tokens == 8  # still answering
    close_bounded(engine)


def test_blocking_call_from_a_callback_during_a_hand_step_is_refused(engine: Engine) -> None:
    """Stepping by hand inside hold(), the callbacks still run on delivery threads, where a blocking
    call is refused as anywhere else (it could hold every delivery thread waiting on itself)."""
    outcomes: list[BaseException | None] = []

    def on_text(_: str) -> None:
        if not outcomes:
            try:
                engine.generate([QUESTIONS[1]], GREEDY)
                outcomes.append(None)
            except BaseException as exc:  # noqa: BLE001 - checked below
                outcomes.append(exc)

    with engine.hold():
        future = engine.submit(QUESTIONS[0], GREEDY, on_text=on_text)
        stepper = in_thread(engine.step)  # not on this thread: a deadlock here must not hang the run
        try:
            assert stepper.result(timeout=TIMEOUT) > 0
        finally:
            if not stepper.done():
                close_bounded(engine)  # fails the inner request: the stuck step ends
    # the future resolves after every piece was handed over, so the callback has run by then
    assert future.result(timeout=TIMEOUT).completion_tokens == 8
    assert len(outcomes) == 1 and isinstance(outcomes[0], InvalidRequestError), outcomes


# ---- scheduler: prompt_logits with adapters goes through it --------------------------------------


@pytest.fixture
def adapter_folders(tokenizer: Any, tmp_path: Path) -> tuple[torch.nn.Module, dict[str, Path]]:
    base = tiny_model("llama", tokenizer)
    folders = {name: make_adapter(base, tmp_path / name, seed=i + 1) for i, name in enumerate("abcdx")}
    return base, folders


def adapter_engine(tokenizer: Any, base: torch.nn.Module, folders: dict[str, Path], **kwargs: Any) -> Engine:
    engine = make_engine(tokenizer, reference_copy(base), **kwargs)
    for name, folder in folders.items():
        engine.load_adapter(name, str(folder))
    return engine


def test_concurrent_prompt_logits_with_two_adapters_each_complete(
    tokenizer: Any, adapter_folders: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, folders = adapter_folders
    engine = adapter_engine(tokenizer, base, folders, max_adapters=2)
    prompts = [QUESTIONS[1], QUESTIONS[3]]
    queued, _ = count_enqueues(engine, monkeypatch)
    with engine.hold():
        pinning = engine.submit(QUESTIONS[0], SamplingParams(max_tokens=30), adapter="x")
        engine.step()  # "x" runs: one of the two slots is pinned while both callers wait
        callers = [in_thread(engine.prompt_logits, prompts, adapters=names) for names in (["a", "b"], ["c", "d"])]
        for _ in range(3):  # the generate above, then both callers: all queued before anything runs
            assert queued.acquire(timeout=TIMEOUT)
    results = [caller.result(timeout=TIMEOUT) for caller in callers]
    assert pinning.result(timeout=TIMEOUT).completion_tokens == 30
    for names, logits in zip((["a", "b"], ["c", "d"]), results):
        for prompt, name, got in zip(prompts, names, logits):
            peft = PeftModel.from_pretrained(reference_copy(base), str(folders[name])).eval()
            with torch.no_grad():
                expected = peft(input_ids=torch.tensor([engine.encode(prompt)])).logits[0]
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    close_bounded(engine)


def test_prompt_logits_naming_more_adapters_than_slots_completes(tokenizer: Any, adapter_folders: Any) -> None:
    base, folders = adapter_folders
    engine = adapter_engine(tokenizer, base, folders, max_adapters=1)
    prompts = [QUESTIONS[1], QUESTIONS[3]]
    both = in_thread(engine.prompt_logits, prompts, adapters=["a", "b"]).result(timeout=TIMEOUT)
    assert engine.stats()["forward_passes"] >= 2  # one slot: one adapter per pass
    alone = [engine.prompt_logits([p], adapters=[n])[0] for p, n in zip(prompts, "ab")]
    for got, expected in zip(both, alone):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert not torch.allclose(alone[0], engine.prompt_logits([prompts[0]])[0], atol=1e-3)  # the adapter applies
    close_bounded(engine)


def test_close_wakes_a_waiting_prompt_logits_caller(
    tokenizer: Any, adapter_folders: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, folders = adapter_folders
    engine = adapter_engine(tokenizer, base, folders, max_adapters=1)
    queued, _ = count_enqueues(engine, monkeypatch)
    with engine.hold():
        caller = in_thread(engine.prompt_logits, [QUESTIONS[1], QUESTIONS[2]], adapters=["a", "b"])
        assert queued.acquire(timeout=TIMEOUT)
        close_bounded(engine)
    assert isinstance(caller.exception(timeout=TIMEOUT), EngineClosedError)


# ---- engine: a caller that stops early cancels what it queued ------------------------------------


def test_wait_cancels_every_queued_future_when_it_raises(engine: Engine) -> None:
    with engine.hold():
        queued = [engine.submit(q, GREEDY) for q in QUESTIONS[:3]]
        with pytest.raises(InvalidRequestError, match="bad one"):
            engine._wait([failed_future(InvalidRequestError("bad one")), *queued], return_exceptions=False)
        assert all(f.cancelled() for f in queued)
        interrupted = [engine.submit(q, GREEDY) for q in QUESTIONS[3:5]]
        with pytest.raises(KeyboardInterrupt):  # never returned in place, even with return_exceptions
            engine._wait([failed_future(KeyboardInterrupt()), *interrupted], return_exceptions=True)
        assert all(f.cancelled() for f in interrupted)
        assert engine.step() == 0  # nothing left to compute
        stats = engine.stats()
        assert stats["cancelled"] == 5 and stats["waiting"] == 0 and stats["generated_tokens"] == 0
    assert engine.generate([QUESTIONS[0]], GREEDY)[0].completion_tokens == 8


def test_generate_interrupted_while_waiting_cancels_its_requests(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, futures = count_enqueues(engine, monkeypatch)

    def ctrl_c(self: Future, timeout: float | None = None) -> Any:
        raise KeyboardInterrupt  # what Ctrl-C does to a caller blocked in future.result()

    with engine.hold():
        with monkeypatch.context() as patch:
            patch.setattr(Future, "result", ctrl_c)
            with pytest.raises(KeyboardInterrupt):
                engine.generate(QUESTIONS[:3], GREEDY)
        assert len(futures) == 3 and all(f.cancelled() for f in futures)
        assert engine.step() == 0
        assert engine.stats()["cancelled"] == 3 and engine.stats()["waiting"] == 0
    assert engine.generate([QUESTIONS[0]], GREEDY)[0].completion_tokens == 8


# ---- lifecycle: a forward that raises ------------------------------------------------------------


def test_a_failed_pass_fails_each_request_with_its_own_error(
    engine: Engine, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    boom = RuntimeError("device lost")
    original = engine._runner.forward  # a pass, whichever way the platform runs it
    calls = []

    def failing_once(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 1:
            raise boom
        return original(*args, **kwargs)

    monkeypatch.setattr(engine._runner, "forward", failing_once)
    with engine.hold():
        futures = [engine.submit(q, GREEDY) for q in DOC_QUESTIONS]
    errors = [f.exception(timeout=TIMEOUT) for f in futures]
    assert all(isinstance(e, PassFailedError) for e in errors), errors
    assert len({id(e) for e in errors}) == len(errors)  # each caller owns its error (tracebacks never mix)
    assert all(e.__cause__ is boom and "device lost" in str(e) for e in errors)
    stats = engine.stats()
    assert stats["kv_cache_bytes"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    # still answering, and the failed pass left nothing findable in the prefix cache
    again = engine.generate(DOC_QUESTIONS, GREEDY)
    assert [r.token_ids for r in again] == solo_tokens(tokenizer, DOC_QUESTIONS, GREEDY)
    assert engine.stats()["kv_cache_bytes"] == 0


# ---- model setup: one model, one live engine; close() gives it back clean ------------------------


def test_a_model_serves_one_live_engine_and_comes_back_clean(tokenizer: Any, tmp_path: Path) -> None:
    """On the transformers fallback an engine changes the model it serves (its attention, LoRA
    layers), so one model serves one live engine; Kev's own path reads its tensors and changes
    nothing, so two engines may share one."""
    model = tiny_model("llama", tokenizer)
    reference = reference_copy(model)
    original_attention = model.config._attn_implementation
    folder = make_adapter(model, tmp_path / "a", seed=1)
    first = make_engine(tokenizer, model, name="first-engine", model_impl="transformers")
    first.load_adapter("a", str(folder))
    assert first.generate([QUESTIONS[0]], GREEDY, adapters="a")[0].completion_tokens == 8
    with pytest.raises(ValueError, match="first-engine"):
        make_engine(tokenizer, model, name="second-engine", model_impl="transformers")
    assert first.generate([QUESTIONS[0]], GREEDY)[0].completion_tokens == 8  # the refusal left it serving
    close_bounded(first)

    assert model.config._attn_implementation == original_attention
    assert not any(isinstance(m, MultiLoRALinear) for m in model.modules())
    ids = torch.tensor([first.encode(QUESTIONS[1])])
    with torch.no_grad():
        expected = reference(input_ids=ids).logits[0]
        torch.testing.assert_close(model(input_ids=ids).logits[0], expected, atol=ATOL, rtol=0)

    second = make_engine(tokenizer, model, name="second-engine", model_impl="transformers")
    second.load_adapter("a", str(folder))
    plain, adapted = second.prompt_logits([QUESTIONS[1], QUESTIONS[1]], adapters=[None, "a"])
    torch.testing.assert_close(plain, expected, atol=ATOL, rtol=0)
    peft = PeftModel.from_pretrained(reference_copy(reference), str(folder)).eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted, peft(input_ids=ids).logits[0], atol=ATOL, rtol=0)
    assert not torch.allclose(plain, adapted, atol=1e-3)
    close_bounded(second)
    own = [make_engine(tokenizer, model, name=f"own-{i}") for i in range(2)]
    assert [e.prompt_logits([QUESTIONS[1]])[0].shape for e in own] == [expected.shape] * 2
    for engine in own:
        close_bounded(engine)


# ---- worker: an engine dropped without close() ---------------------------------------------------


def test_an_engine_dropped_without_close_is_collected_and_its_thread_ends(tokenizer: Any) -> None:
    engine = make_engine(tokenizer)
    assert engine.generate([QUESTIONS[0]], GREEDY)[0].completion_tokens == 8
    thread, idle = engine._worker.thread, engine._worker.idle
    assert thread is not None and idle.wait(TIMEOUT)  # it waits with nothing to do: it has let go of the engine
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    assert dropped() is None
    thread.join(TIMEOUT)
    assert not thread.is_alive()


# ---- lifecycle: a cancelled queued request lets go of its adapter at once ------------------------


def test_cancelled_queued_request_releases_its_adapter_at_once(tokenizer: Any, tmp_path: Path) -> None:
    model = tiny_model("llama", tokenizer)
    old, new = make_adapter(model, tmp_path / "old", seed=1), make_adapter(model, tmp_path / "new", seed=2)
    engine = make_engine(tokenizer, model, max_num_seqs=1)
    engine.load_adapter("a", str(old))
    with engine.hold():
        running = engine.submit(QUESTIONS[0], SamplingParams(max_tokens=20))
        engine.step()  # it takes the only sequence slot: the next request stays queued behind it
        queued = engine.submit(QUESTIONS[1], GREEDY, adapter="a")
        assert queued.cancel()
        engine.step()
        assert engine.stats()["cancelled"] == 1 and engine.stats()["waiting"] == 0
        engine.unload_adapter("a")
        assert "a" not in engine.adapters
        engine.load_adapter("a", str(new))  # the name is free now, not after the running request ends
        assert not running.done()
    assert running.result(timeout=TIMEOUT).completion_tokens == 20
    assert engine.generate([QUESTIONS[1]], GREEDY, adapters="a")[0].completion_tokens == 8
    close_bounded(engine)


# ---- engine: prompt_logits after close() ---------------------------------------------------------


def test_every_call_after_close_raises_engine_closed(engine: Engine) -> None:
    assert engine.prompt_logits([QUESTIONS[0]])[0].shape[0] == len(engine.encode(QUESTIONS[0]))
    close_bounded(engine)
    with pytest.raises(EngineClosedError):
        engine.prompt_logits([QUESTIONS[0]])
    with pytest.raises(EngineClosedError):
        engine.generate([QUESTIONS[0]], GREEDY)
    with pytest.raises(EngineClosedError):
        engine.submit(QUESTIONS[0])


# ---- test-suite care ------------------------------------------------------------------------------


def test_top_k_and_top_p_keep_exactly_what_they_should() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5 (1), 0.3 (3), 0.15 (2), 0.05 (0)
    logits = probs.log().repeat(6, 1)  # [6, 4]
    top_k = torch.tensor([2, 0, 0, 0, 0, 1])
    top_p = torch.tensor([1.0, 0.45, 0.6, 0.9, 1.0, 0.9])
    kept = torch.isfinite(apply_top_k_top_p(logits, top_k, top_p))
    assert kept.tolist() == [
        [False, True, False, True],  # top_k=2: the two most likely
        [False, True, False, False],  # top_p=0.45: 0.5 alone reaches it
        [False, True, False, True],  # top_p=0.6: 0.5 + 0.3
        [False, True, True, True],  # top_p=0.9: 0.5 + 0.3 + 0.15
        [True, True, True, True],  # both off
        [False, True, False, False],  # top_k=1 wins over a looser top_p
    ]
    filtered = apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(filtered[kept], logits[kept])  # what is kept is untouched


def test_close_fails_queued_and_running_requests(tokenizer: Any) -> None:
    engine = make_engine(tokenizer, max_num_seqs=1)
    with engine.hold():
        running = engine.submit(QUESTIONS[0], SamplingParams(max_tokens=50))
        engine.step()
        queued = engine.submit(QUESTIONS[1], GREEDY)
        assert engine.stats()["running"] == 1 and engine.stats()["waiting"] == 1
        close_bounded(engine)
    assert isinstance(running.exception(timeout=TIMEOUT), EngineClosedError)
    assert isinstance(queued.exception(timeout=TIMEOUT), EngineClosedError)
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_cache_bytes"] == 0


def test_an_answer_reaching_the_context_ends_with_length(engine: Engine) -> None:
    prompt = "word " * 1015
    result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=100))[0]
    assert result.prompt_tokens == 1016
    assert result.completion_tokens == 1024 - 1016 and result.finish_reason == "length"


def test_max_num_seqs_bounds_every_pass(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(tokenizer, max_num_seqs=2)
    segments: list[int] = []
    original = engine._runner.forward  # every pass, whichever way the platform runs it

    def counting(batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        segments.append(batch.num_segments)
        return original(batch, *args, **kwargs)

    monkeypatch.setattr(engine._runner, "forward", counting)
    lengths = (3, 5, 7, 2, 4)
    with engine.hold():
        futures = [engine.submit(q, SamplingParams(max_tokens=n)) for q, n in zip(QUESTIONS, lengths)]
        for _ in range(100):
            engine.step()
            assert engine.stats()["running"] <= 2
            if all(f.done() for f in futures):
                break
    assert [f.result(timeout=TIMEOUT).completion_tokens for f in futures] == list(lengths)
    assert max(segments) == 2 and len(segments) >= sum(lengths) / 2
    close_bounded(engine)


def test_stream_never_splits_a_character(engine: Engine, tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "Hi 😀 and 日本語 🎉 ok"
    script = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in script)  # some tokens are partial characters
    drawn = iter(script)

    def scripted(logits: torch.Tensor, **_: Any) -> torch.Tensor:
        return torch.tensor([next(drawn) for _ in range(logits.shape[0])])

    monkeypatch.setattr(sample_module, "sample", scripted)
    pieces = list(engine.stream(QUESTIONS[0], SamplingParams(max_tokens=len(script) + 5)))
    assert len(pieces) > 3 and not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == text


def test_hot_temperature_update_changes_sampling(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEV_TEMPERATURE", raising=False)
    engine = make_engine(tokenizer)
    unset = SamplingParams(seed=7, max_tokens=16)  # temperature=None: the engine default
    greedy = engine.generate([QUESTIONS[0]], unset)[0]
    explicit_greedy = engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=16))[0]
    assert greedy.token_ids == explicit_greedy.token_ids
    engine.set_defaults(temperature=1.5)
    hot = engine.generate([QUESTIONS[0]], unset)[0]
    explicit = engine.generate([QUESTIONS[0]], SamplingParams(temperature=1.5, seed=7, max_tokens=16))[0]
    assert hot.settings_version == 1 and hot.token_ids == explicit.token_ids
    assert hot.token_ids != greedy.token_ids
    close_bounded(engine)
