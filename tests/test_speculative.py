"""Speculative decoding that changes no bit: drafts looked up in a question's own text, or written by
a draft model (kev_engine/draft_model.py), verified as extra rows of its segment in the packed pass
(kev_engine/core/drafts.py, `Stepper._walk_drafts`).

Every comparison is bitwise: the tokens, the logits each token was drawn from (`torch.equal`), the
logprobs and the finish reasons of an engine with speculation on against the same weights with it
off, alone and packed, greedy and seeded with penalties. The models are tiny random ones whose
greedy answers fall into loops (initializer_range 0.05), so their drafts are taken often and
missed often; each test checks both happened. Whether a draft pays is priced by a cost model
given here (a pass's fixed second dwarfs its rows: every draft joins), never by the clock. The
control breaks invariance by the pass's row count on purpose (`reorder_by_pass_size`): there the
same comparison finds the verified rows' differences. The draft models are tiny engines too: the
model's own weights (their greedy drafts mostly taken) or other random ones (mostly missed).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FAMILIES, QUESTIONS, chat, tiny_model, two_adapters
from test_invariance import DTYPES, reorder_by_pass_size

from kev_engine import Engine, SamplingParams
from kev_engine.core.blocks import BlockManager, BlockTable
from kev_engine.core.drafts import MAX_DRAFT, Acceptance, Drafter, speculative_mode
from kev_engine.core.pass_cost import CostModel, Work

LOOPING = {"initializer_range": 0.05}  # flatter random weights: greedy answers repeat themselves
BLOCK_BYTES = 2 * 2 * 2 * 16 * 32 * 4  # a tiny qwen3 block: layers x (K, V) x KV heads x head dim x 32 tokens x fp32


def drafts_pay(engine: Engine) -> Engine:
    """Price every draft in: a pass takes a second whatever its rows (a memory-bound step, exaggerated)."""
    engine._scheduler.cost = CostModel(Work.of(engine.model), seconds_per_flop=1e-18, fixed_s=1.0, learn=False)
    return engine


@contextlib.contextmanager
def pair(family: str, tokenizer: Any, dtype: torch.dtype = torch.float32,
         **kwargs: Any) -> Iterator[tuple[Engine, Engine]]:
    """(speculation off, speculation on) engines over the same weights, closed after."""
    off = Engine(tiny_model(family, tokenizer, **LOOPING).to(dtype), tokenizer, speculative="off", **kwargs)
    on = drafts_pay(Engine(tiny_model(family, tokenizer, **LOOPING).to(dtype), tokenizer, speculative="ngram",
                           **kwargs))
    try:
        yield off, on
    finally:
        off.close()
        on.close()


def run(engine: Engine, prompts: list[Any], sampling: list[SamplingParams], adapters: list[Any] | None = None,
        alone: bool = False) -> list[tuple[Any, torch.Tensor]]:
    """(Completion, the logits each token was drawn from) per prompt: one packed call, or one call each."""
    if alone:
        return [answer for i in range(len(prompts))
                for answer in run(engine, prompts[i : i + 1], sampling[i : i + 1],
                                  None if adapters is None else adapters[i : i + 1])]
    return engine.generate_with_logits(prompts, sampling, adapters)


def differences(first: list[tuple[Any, torch.Tensor]], second: list[tuple[Any, torch.Tensor]]) -> list[int]:
    """Indices of the answers that are not bitwise the same: tokens, logits, logprobs, finish, text."""
    def same(a: tuple[Any, torch.Tensor], b: tuple[Any, torch.Tensor]) -> bool:
        (x, x_logits), (y, y_logits) = a, b
        return (x.token_ids == y.token_ids and x.finish_reason == y.finish_reason and x.text == y.text
                and x.logprobs == y.logprobs and x_logits.shape == y_logits.shape and torch.equal(x_logits, y_logits))
    return [i for i, (a, b) in enumerate(zip(first, second)) if not same(a, b)]


def verified(engine: Engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["draft_tokens"], stats["draft_accepted_tokens"]


def assert_drafts_taken_and_missed(engine: Engine) -> None:
    drafted, taken = verified(engine)
    assert 0 < taken < drafted, f"{taken} of {drafted} draft tokens taken: the walk was not exercised both ways"


def mixed_settings(count: int, max_tokens: int = 40) -> list[SamplingParams]:
    """Greedy with logprobs, seeded sampling with penalties, greedy with min_tokens and a repetition penalty."""
    kinds = [
        lambda i: SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=True, top_logprobs=3, ignore_eos=True),
        lambda i: SamplingParams(temperature=0.7, seed=40 + i, max_tokens=max_tokens, frequency_penalty=0.3,
                                 presence_penalty=0.2, logprobs=True, ignore_eos=True),
        lambda i: SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens // 2,
                                 repetition_penalty=1.1),
    ]
    return [kinds[i % len(kinds)](i) for i in range(count)]


# ---- drafts ---------------------------------------------------------------------------------


def test_a_draft_follows_the_most_recent_longest_match() -> None:
    ids = [1, 2, 3, 9, 9, 5, 2, 3, 4, 7, 8, 1, 2, 3]
    # 4-grams [2,3]... end "1 2 3": "1 2 3" occurred at 0 (then 9); "2 3" last occurred at 6 (then 4):
    # the longest match first, so 9, 9, 5 follow
    assert Drafter().propose(ids, 3) == [9, 9, 5]
    assert Drafter().propose([5, 6, 7, 1, 2, 5, 6, 8, 1, 2], 2) == [5, 6]  # "1 2" most recently at 3, then 5 6
    assert Drafter().propose([1, 2, 3, 4], 4) == []  # nothing of its end occurred before
    assert Drafter().propose([4, 4], 3) == []  # its own end never matches itself


def test_a_draft_past_the_end_repeats_the_loop() -> None:
    # "7 8" occurred at 2, followed by 9 7 8: past the end the draft goes on with its own start
    assert Drafter().propose([1, 2, 7, 8, 9, 7, 8], 5) == [9, 7, 8, 9, 7]


def test_the_index_keys_are_ints_the_garbage_collector_never_scans() -> None:
    """A prompt's n-grams are indexed as packed ints, not tuples: every token of every prompt made
    tuples the collector counted and scanned, and a full collection stalled whichever pass it landed
    in (RAG-16 took up to 10 % longer with speculation on, drafting nothing)."""
    import gc

    from kev_engine.core.drafts import _key

    drafter = Drafter()
    drafter.propose(list(range(100, 400)) * 2, 3)
    assert drafter.index and not any(gc.is_tracked(key) for key in drafter.index)
    assert _key([7, 9]) != _key([7, 9, 0]) != _key([7, 9, 0, 0])  # lengths never share a key
    assert gc.is_tracked(tuple([7, 9, [0]]))  # control: a container the collector tracks is seen as one


def test_the_index_grows_as_a_fresh_one_is_built() -> None:
    grown, ids = Drafter(), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    for token in [8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]:
        ids.append(token)
        fresh = Drafter()
        assert grown.propose(ids, MAX_DRAFT) == fresh.propose(ids, MAX_DRAFT)
        assert grown.index == fresh.index


def test_acceptance_is_the_questions_first_token_then_the_engines_depth_rates() -> None:
    acceptance, drafter = Acceptance(), Drafter()
    assert acceptance.chances(drafter, 3) == [0.5, 0.25, 0.125]  # 1 in 2 before anything is known
    for _ in range(8):
        acceptance.record(drafter, length=3, taken=1)  # the first token taken, the second missed, every time
    first, second, third = acceptance.chances(drafter, 3)
    assert first == pytest.approx((8 + 2 * 0.9) / 10) and second == pytest.approx(first * 0.1)
    assert third == pytest.approx(second * 0.5)  # depth 3 never checked: its prior
    assert acceptance.chances(Drafter(), 1) == [pytest.approx(0.9)]  # a new question starts at the engine's rate


def test_blocks_past_an_answer_are_freed() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    table = BlockTable()
    assert blocks.allocate(table, list(range(6)), None) == 0
    assert blocks.grow(table, 6 + 7)  # a draft of 7 rows: 4 blocks
    blocks.commit(table, list(range(6)), None, 4)  # one full block computed and keyed
    blocks.shrink(table, 7)
    assert len(table.block_ids) == 2 and blocks.num_available == 6
    blocks.shrink(table, 1)  # never below the keyed blocks
    assert len(table.block_ids) == 1


def test_the_mode_is_checked_and_auto_follows_invariance(monkeypatch: pytest.MonkeyPatch) -> None:
    assert speculative_mode(None, batch_invariant=True) == "ngram"
    assert speculative_mode("auto", batch_invariant=False) == "off"
    monkeypatch.setenv("KEV_SPECULATIVE", "off")
    assert speculative_mode(None, batch_invariant=True) == "off"
    monkeypatch.setenv("KEV_SPECULATIVE", "eagle")
    with pytest.raises(ValueError, match=r"KEV_SPECULATIVE='eagle' is not allowed; use one of \['auto', 'ngram'"):
        speculative_mode(None, batch_invariant=True)
    with pytest.raises(ValueError, match="needs a batch-invariant engine"):
        speculative_mode("ngram", batch_invariant=False)


def test_from_pretrained_refuses_a_bad_mode_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    from kev_engine import loader

    monkeypatch.setattr(loader, "load", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    with pytest.raises(ValueError, match=r"speculative='eagle' is not allowed"):
        Engine.from_pretrained(speculative="eagle")


def test_an_engine_says_its_mode_and_refuses_ngram_without_invariance(tokenizer) -> None:
    with pytest.raises(ValueError, match="speculative='ngram' needs a batch-invariant engine"):
        Engine(tiny_model("llama", tokenizer), tokenizer, speculative="ngram", batch_invariant=False)
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, speculative="off")
    try:
        assert engine.stats()["speculative"] == "off"
        assert engine.stats()["draft_tokens"] == 0
    finally:
        engine.close()


# ---- the same bits with speculation on and off ----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_speculation_changes_no_bit_packed_and_alone(family: str, dtype: torch.dtype, tokenizer) -> None:
    with pair(family, tokenizer, dtype) as (off, on):
        sampling = mixed_settings(len(QUESTIONS))
        plain = run(off, QUESTIONS, sampling)
        assert differences(plain, run(on, QUESTIONS, sampling)) == []
        assert_drafts_taken_and_missed(on)
        assert on.stats()["generated_tokens"] == off.stats()["generated_tokens"]
        assert differences(plain, run(on, QUESTIONS, sampling, alone=True)) == []


def test_a_repeating_answer_takes_fewer_passes(tokenizer) -> None:
    with pair("llama", tokenizer) as (off, on):
        greedy = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)]
        assert differences(run(off, QUESTIONS[:1], greedy), run(on, QUESTIONS[:1], greedy)) == []
        assert on.stats()["decode_steps"] < off.stats()["decode_steps"] == 59


def test_stop_strings_inside_a_draft_end_the_answer_where_they_would(tokenizer) -> None:
    with pair("llama", tokenizer) as (off, on):
        greedy = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)] * len(QUESTIONS)
        texts = [completion.text for completion, _ in run(off, QUESTIONS, greedy)]
        stopped = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=[text[-40:-36]])
                   for text in texts]  # somewhere in the loop: the answer ends inside a taken draft
        plain = run(off, QUESTIONS, stopped)
        assert all(completion.finish_reason == "stop" for completion, _ in plain)
        assert differences(plain, run(on, QUESTIONS, stopped)) == []
        assert_drafts_taken_and_missed(on)


def test_chunked_prefill_preemption_and_samples_with_drafts(tokenizer) -> None:
    """Prompts in 48-token chunks beside verified drafts, a pool small enough to preempt, n=2 samples."""
    off = Engine(tiny_model("qwen3", tokenizer, **LOOPING), tokenizer, speculative="off")
    on = drafts_pay(Engine(tiny_model("qwen3", tokenizer, **LOOPING), tokenizer, speculative="ngram",
                           max_batch_tokens=48, max_num_seqs=8, kv_cache_bytes=14 * BLOCK_BYTES, block_size=32))
    try:
        prompts = [chat(f"Question {i}: say it again.", "the mill and the bridge " * (3 + 4 * i)) for i in range(6)]
        sampling = mixed_settings(len(prompts), max_tokens=30)
        sampling[0] = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=30, ignore_eos=True)
        plain = off.generate(prompts, sampling)
        spoken = on.generate(prompts, sampling)
        for a, b in zip(plain, spoken):
            assert [(s.token_ids, s.logprobs, s.finish_reason) for s in (a.samples or [a])] == \
                   [(s.token_ids, s.logprobs, s.finish_reason) for s in (b.samples or [b])]
        assert_drafts_taken_and_missed(on)
        assert on.stats()["preemptions"] > 0
    finally:
        off.close()
        on.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_adapters_per_question_with_drafts(dtype: torch.dtype, tokenizer, tmp_path) -> None:
    base = tiny_model("qwen2", tokenizer, **LOOPING)
    folders = two_adapters(base, tmp_path, scale=0.02)
    with pair("qwen2", tokenizer, dtype) as (off, on):
        for engine in (off, on):
            for name, folder in folders.items():
                engine.load_adapter(name, str(folder))
        names = [("qv", "all", None)[i % 3] for i in range(len(QUESTIONS))]
        sampling = mixed_settings(len(QUESTIONS))
        assert differences(run(off, QUESTIONS, sampling, names), run(on, QUESTIONS, sampling, names)) == []
        assert_drafts_taken_and_missed(on)


def test_a_constrained_answer_parses_with_drafts(tokenizer) -> None:
    """The grammar's matcher takes each drawn token as plain decoding's would: a draft token the
    grammar forbids is simply never drawn, so nothing is rolled back."""
    schema = {"type": "object", "properties": {"names": {"type": "array", "items": {"enum": ["Ada", "Bo", "Cy"]},
                                                         "minItems": 6, "maxItems": 9}},
              "required": ["names"], "additionalProperties": False}
    with pair("llama", tokenizer) as (off, on):
        sampling = [SamplingParams(temperature=0, max_tokens=120, json_schema=schema)] * 3
        prompts = [chat("List some names as JSON."), chat("Names, please."), chat("Three names.")]
        plain, spoken = run(off, prompts, sampling), run(on, prompts, sampling)
        assert differences(plain, spoken) == []
        for completion, _ in spoken:
            assert completion.finish_reason == "stop"
            assert 6 <= len(json.loads(completion.text)["names"]) <= 9
        assert verified(on)[1] > 0


def test_the_embedded_model_with_drafts_is_bitwise_the_same(tokenizer) -> None:
    for dtype in ("float32", "bfloat16"):
        off = Engine.from_pretrained(dtype=dtype, speculative="off")
        on = drafts_pay(Engine.from_pretrained(dtype=dtype, speculative="ngram"))
        try:
            document = ("The Halloway canal opened to barges in 1823. It runs 42 miles from Brent to the sea, "
                        "through eleven locks built of local granite.")
            prompts = [chat("When did the Halloway canal open, and how long is it?", document),
                       chat("What were the locks of the Halloway canal built of?", document)]
            sampling = [SamplingParams(temperature=0, max_tokens=40, logprobs=True)] * 2
            assert differences(run(off, prompts, sampling), run(on, prompts, sampling)) == []
            assert verified(on)[1] > 0
        finally:
            off.close()
            on.close()


def test_every_block_comes_back(tokenizer) -> None:
    with pair("llama", tokenizer) as (_, on):
        on.generate(QUESTIONS, mixed_settings(len(QUESTIONS)))
        assert verified(on)[0] > 0
        assert on._blocks.num_available == on._blocks.num_blocks


# ---- a draft model ---------------------------------------------------------------------------------


@contextlib.contextmanager
def drafted_by(family: str, tokenizer: Any, draft_seed: int, dtype: torch.dtype = torch.float32,
               **kwargs: Any) -> Iterator[Engine]:
    """An engine whose drafts a tiny model of `draft_seed` writes (seed 0: the model's own weights,
    whose greedy drafts are taken; another seed: drafts that are mostly missed), closed after."""
    draft = Engine(tiny_model(family, tokenizer, seed=draft_seed, **LOOPING).to(dtype), tokenizer, speculative="off")
    engine = drafts_pay(Engine(tiny_model(family, tokenizer, **LOOPING).to(dtype), tokenizer, draft_model=draft,
                               **kwargs))
    try:
        yield engine
    finally:
        engine.close()
        draft.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_draft_model_changes_no_bit_packed_and_alone(family: str, dtype: torch.dtype, tokenizer) -> None:
    off = Engine(tiny_model(family, tokenizer, **LOOPING).to(dtype), tokenizer, speculative="off")
    try:
        sampling = mixed_settings(len(QUESTIONS))
        plain = run(off, QUESTIONS, sampling)
        for seed in (0, 1):
            with drafted_by(family, tokenizer, seed, dtype) as on:
                assert on.stats()["speculative"] == "model"
                assert differences(plain, run(on, QUESTIONS, sampling)) == []
                assert differences(plain, run(on, QUESTIONS, sampling, alone=True)) == []
                drafted, taken = verified(on)
                assert drafted > 0
                if seed == 0:
                    assert_drafts_taken_and_missed(on)
                assert on.stats()["draft_seconds"] > 0
    finally:
        off.close()


def test_a_draft_model_with_chunked_prefill_samples_and_adapters(tokenizer, tmp_path) -> None:
    base = tiny_model("qwen2", tokenizer, **LOOPING)
    folders = two_adapters(base, tmp_path, scale=0.02)
    off = Engine(tiny_model("qwen2", tokenizer, **LOOPING), tokenizer, speculative="off")
    with drafted_by("qwen2", tokenizer, 0, max_batch_tokens=48, max_num_seqs=8) as on:
        try:
            for engine in (off, on):
                for name, folder in folders.items():
                    engine.load_adapter(name, str(folder))
            prompts = [chat(f"Question {i}: say it again.", "the mill and the bridge " * (3 + 4 * i)) for i in range(6)]
            sampling = mixed_settings(len(prompts), max_tokens=30)
            sampling[0] = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=30, ignore_eos=True)
            names = [("qv", "all", None)[i % 3] for i in range(len(prompts))]
            plain = off.generate(prompts, sampling, adapters=names)
            spoken = on.generate(prompts, sampling, adapters=names)
            for a, b in zip(plain, spoken):
                assert [(s.token_ids, s.logprobs, s.finish_reason) for s in (a.samples or [a])] == \
                       [(s.token_ids, s.logprobs, s.finish_reason) for s in (b.samples or [b])]
            assert_drafts_taken_and_missed(on)
            assert on._blocks.num_available == on._blocks.num_blocks
        finally:
            off.close()


def test_a_constrained_answer_parses_with_a_draft_model(tokenizer) -> None:
    """The draft model writes unconstrained drafts; the grammar's matcher takes only drawn tokens."""
    schema = {"type": "object", "properties": {"names": {"type": "array", "items": {"enum": ["Ada", "Bo", "Cy"]},
                                                         "minItems": 6, "maxItems": 9}},
              "required": ["names"], "additionalProperties": False}
    with pair("llama", tokenizer) as (off, _), drafted_by("llama", tokenizer, 0) as on:
        sampling = [SamplingParams(temperature=0, max_tokens=120, json_schema=schema)] * 2
        prompts = [chat("List some names as JSON."), chat("Names, please.")]
        plain, spoken = run(off, prompts, sampling), run(on, prompts, sampling)
        assert differences(plain, spoken) == []
        for completion, _ in spoken:
            assert 6 <= len(json.loads(completion.text)["names"]) <= 9
        assert verified(on)[0] > 0


def test_a_draft_model_that_does_not_pay_is_turned_down(tokenizer) -> None:
    """Drafts that save nothing (each taken token priced at no time): after its first drafts the
    draft model drafts only for one pass in PROBE_EVERY; the answers stay the same."""
    from kev_engine.draft_model import PROBE_EVERY, WARMUP_DRAFTS

    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with pair("llama", tokenizer) as (off, _), drafted_by("llama", tokenizer, 1) as on:
        on._draft.saved_per_token = lambda rows: 0.0
        assert differences(run(off, QUESTIONS[:1], [greedy]), run(on, QUESTIONS[:1], [greedy])) == []
        draft = on._draft
        assert draft.passes > WARMUP_DRAFTS + 2 * PROBE_EVERY
        assert WARMUP_DRAFTS <= draft.drafting <= WARMUP_DRAFTS + draft.passes // PROBE_EVERY + 1


def test_a_draft_model_writes_no_draft_that_no_pass_would_take(tokenizer) -> None:
    """Rows that cost what tokens are worth (no fixed part in a pass): no draft would price in,
    so the draft model is never asked for one."""
    with drafted_by("llama", tokenizer, 0) as on:
        on._scheduler.cost = CostModel(Work.of(on.model), seconds_per_flop=1e-9, fixed_s=0.0, learn=False)
        on.generate(QUESTIONS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert verified(on) == (0, 0)
        assert on._draft.passes > 0 and on._draft.drafting == 0


def test_a_draft_model_that_fails_stops_drafting_and_the_answers_go_on(tokenizer, caplog) -> None:
    greedy = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * len(QUESTIONS)
    with pair("llama", tokenizer) as (off, _), drafted_by("llama", tokenizer, 0) as on:
        on._draft.engine.close()  # given as an Engine, closed under the engine it drafts for
        with caplog.at_level("WARNING", logger="kev"):
            assert differences(run(off, QUESTIONS, greedy), run(on, QUESTIONS, greedy)) == []
        assert "drafts no more" in caplog.text and "closed" in on._draft.failed
        assert verified(on) == (0, 0)


def test_a_draft_model_is_checked_before_it_drafts(tokenizer, embedded_dir) -> None:
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="speculative='model' needs draft_model="):
        Engine(tiny_model("llama", tokenizer), tokenizer, speculative="model")
    drafting = Engine(tiny_model("llama", tokenizer), tokenizer, speculative="ngram")
    other_tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    other_tokenizer.add_tokens(["<kev-extra>"])
    stranger = Engine(tiny_model("llama", other_tokenizer), other_tokenizer, speculative="off")
    try:
        with pytest.raises(ValueError, match="draft_model= was given with speculative='ngram'"):
            Engine(tiny_model("llama", tokenizer), tokenizer, speculative="ngram", draft_model=drafting)
        with pytest.raises(ValueError, match="drafts itself"):
            Engine(tiny_model("llama", tokenizer), tokenizer, draft_model=drafting)
        with pytest.raises(ValueError, match="has another tokenizer"):
            Engine(tiny_model("llama", tokenizer), tokenizer, draft_model=stranger)
        with pytest.raises(TypeError, match="draft_model=3 is not allowed"):
            Engine(tiny_model("llama", tokenizer), tokenizer, draft_model=3)
        with pytest.raises(ValueError, match="needs a batch-invariant engine"):
            Engine(tiny_model("llama", tokenizer), tokenizer, speculative="model", draft_model=stranger,
                   batch_invariant=False)
        with pytest.raises(ValueError, match="speculative='model' needs draft_model="):
            Engine.from_pretrained("/nonexistent", speculative="model")  # before the load
        with pytest.raises(FileNotFoundError, match="draft_model='/nonexistent/draft' could not be loaded"):
            Engine(tiny_model("llama", tokenizer), tokenizer, draft_model="/nonexistent/draft")
    finally:
        drafting.close()
        stranger.close()


def test_the_embedded_model_drafted_by_its_own_first_layers_is_bitwise_the_same(tokenizer, embedded_dir,
                                                                              tmp_path) -> None:
    """A draft model loaded by name (the embedded model's first 6 layers, saved as a folder)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from random_models import first_layers

    folder = first_layers(Path(embedded_dir), 6, tmp_path / "draft")
    off = Engine.from_pretrained(dtype="bfloat16", speculative="off")
    on = drafts_pay(Engine.from_pretrained(dtype="bfloat16", draft_model=str(folder)))
    try:
        assert on.stats()["draft_model"] == "draft"  # the engine's name for the folder
        document = "The Halloway canal opened to barges in 1823. It runs 42 miles from Brent to the sea."
        prompts = [chat("When did the Halloway canal open?", document), chat("How long is the canal?", document)]
        sampling = [SamplingParams(temperature=0, max_tokens=24, logprobs=True)] * 2
        assert differences(run(off, prompts, sampling), run(on, prompts, sampling)) == []
        assert verified(on)[0] > 0
    finally:
        off.close()
        on.close()
    assert on._draft.engine.closed  # a draft model loaded by name is closed with its engine


# ---- drafts are priced, and the control --------------------------------------------------------


def test_no_draft_where_rows_cost_what_tokens_are_worth(tokenizer) -> None:
    """A pass whose time is all in its rows (no fixed part): a draft row costs as much as a sampled
    one, so none pays."""
    engine = Engine(tiny_model("llama", tokenizer, **LOOPING), tokenizer, speculative="ngram")
    engine._scheduler.cost = CostModel(Work.of(engine.model), seconds_per_flop=1e-9, fixed_s=0.0, learn=False)
    try:
        engine.generate(QUESTIONS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert verified(engine) == (0, 0)
    finally:
        engine.close()


def test_control_a_shape_dependent_kernel_shows_in_the_comparison(tokenizer) -> None:
    """The same comparison on an engine whose products depend on the pass's row count: the rows
    speculation adds change the sums, and the comparison sees it."""
    with pair("llama", tokenizer) as (off, on):
        reorder_by_pass_size(off.model)
        reorder_by_pass_size(on.model)
        sampling = mixed_settings(len(QUESTIONS))
        assert differences(run(off, QUESTIONS, sampling), run(on, QUESTIONS, sampling)) != []


def test_control_a_shape_dependent_kernel_shows_with_a_draft_model(tokenizer) -> None:
    off = Engine(tiny_model("llama", tokenizer, **LOOPING), tokenizer, speculative="off")
    with drafted_by("llama", tokenizer, 0) as on:
        try:
            reorder_by_pass_size(off.model)
            reorder_by_pass_size(on.model)
            sampling = mixed_settings(len(QUESTIONS))
            assert differences(run(off, QUESTIONS, sampling), run(on, QUESTIONS, sampling)) != []
        finally:
            off.close()


# ---- the front ends' switch -----------------------------------------------------------------------


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch, tiny_engine: Engine) -> list[dict[str, Any]]:
    """The settings each shared engine a front end builds is loaded with (the tiny engine stands in)."""
    from kev_integrations.shared import clear_shared_engines

    calls: list[dict[str, Any]] = []

    def from_pretrained(model: Any = None, **kwargs: Any) -> Engine:
        calls.append(kwargs)
        return tiny_engine

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setattr(tiny_engine, "close", lambda: None)  # the fixture closes it
    clear_shared_engines()
    yield calls
    clear_shared_engines()


def test_chatkev_kevllm_and_llamaindex_build_their_engine_with_speculative(built: list[dict[str, Any]]) -> None:
    from kev_integrations.langchain import ChatKev, KevLLM
    from kev_integrations.llamaindex import Kev

    ChatKev(speculative="off", device="cpu", dtype="float32").get_engine()
    KevLLM(speculative="ngram", device="cpu", dtype="bfloat16").get_engine()
    Kev(speculative="auto", device="cpu", dtype="float16").get_engine()
    assert [call.get("speculative") for call in built] == ["off", "ngram", "auto"]
    ChatKev(device="cpu", dtype="float32").get_engine()  # the same engine: no new load, no conflict
    assert len(built) == 3
    KevLLM(speculative="model", draft_model="small", device="cpu", dtype="float32", model="big").get_engine()
    Kev(draft_model="small", device="cpu", dtype="float32", model="large").get_engine()
    assert [(call.get("speculative"), call.get("draft_model")) for call in built[3:]] == \
        [("model", "small"), (None, "small")]


def test_the_front_ends_refuse_a_bad_mode_and_one_they_cannot_apply(tiny_engine: Engine) -> None:
    from pydantic import ValidationError

    from kev_integrations.langchain import ChatKev
    from kev_integrations.llamaindex import Kev

    with pytest.raises(ValidationError, match="speculative"):
        ChatKev(speculative="eagle")
    with pytest.raises(ValidationError, match="speculative"):
        Kev(speculative="eagle")
    with pytest.raises(ValueError, match="the engine= given has its own"):
        ChatKev(engine=tiny_engine, speculative="off").get_engine()
    with pytest.raises(ValueError, match="the engine= given has its own"):
        Kev(engine=tiny_engine, draft_model="small").get_engine()
    with pytest.raises(ValueError, match="chosen by the server"):
        ChatKev(base_url="http://127.0.0.1:9", speculative="off").get_engine()


def test_draft_rows_keep_the_pass_in_its_product_shape() -> None:
    """On AMX a bf16 pass of at most 16 rows is one streaming tile: drafts fill it, never pass it;
    the other paths read each weight once per 96 rows."""
    from types import SimpleNamespace

    from kev_engine.platforms.cpu.platform import CpuPlatform

    def platform(path: str) -> Any:
        cpu = object.__new__(CpuPlatform)
        cpu.kernels, cpu.batch_invariant = SimpleNamespace(bf16_path=SimpleNamespace(path=path)), True
        return cpu

    amx, fma = platform("amx"), platform("fma")
    assert [amx.rows_alike(rows, torch.bfloat16) for rows in (1, 16, 17, 32, 33)] == [16, 16, 32, 32, 64]
    assert [amx.rows_alike(rows, torch.float32) for rows in (1, 96, 97)] == [96, 96, 192]
    assert [fma.rows_alike(rows, torch.bfloat16) for rows in (1, 16, 17)] == [96, 96, 96]


def test_a_full_tile_takes_no_draft(tokenizer) -> None:
    """Where every row the pass could add would change its products' shape, no draft joins,
    however well drafts pay."""
    engine = drafts_pay(Engine(tiny_model("llama", tokenizer, **LOOPING), tokenizer, speculative="ngram"))
    engine._scheduler.rows_alike = lambda rows: rows
    try:
        engine.generate(QUESTIONS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert verified(engine) == (0, 0)
    finally:
        engine.close()


def test_the_measured_cost_of_a_decode_row_is_the_slope_over_its_passes() -> None:
    from kev_engine.core.pass_cost import RowCost

    cost = RowCost()
    assert cost.per_row() is None
    for rows, seconds in ((16, 0.030), (16, 0.030)):
        cost.observe(rows, seconds)
    assert cost.per_row() is None  # one row count: no slope yet
    for rows, seconds in ((4, 0.018), (1, 0.015)):
        cost.observe(rows, seconds)
    assert cost.per_row() == pytest.approx(0.001)


def test_a_draft_row_measured_dearer_than_predicted_is_turned_down(tokenizer) -> None:
    """The cost model's flops say a row is free (drafts_pay), but decode passes measured a second a
    row: what was measured prices the draft, and none joins."""
    from types import SimpleNamespace

    engine = drafts_pay(Engine(tiny_model("llama", tokenizer, **LOOPING), tokenizer, speculative="ngram"))
    engine._scheduler.row_cost = SimpleNamespace(per_row=lambda: 1.0, observe=lambda rows, seconds: None)
    try:
        engine.generate(QUESTIONS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert verified(engine) == (0, 0)
    finally:
        engine.close()
