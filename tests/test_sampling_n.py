"""n > 1 samples of one prompt: one prefill, n decode rows forked from its KV, reproducible seeds.

A forked sample must answer exactly as the same sample computed from scratch (its prompt
prefilled by itself, with the seed `fanout.sample_seed` derives): that is what shows the
shared and copied KV blocks hold the right prompt."""

from __future__ import annotations

import pytest
from conftest import QUESTIONS, chat, tiny_model

from kev_engine import Engine, InvalidRequestError, SamplingParams
from kev_engine.core.fanout import sample_seed

# 32-token blocks on CPU: a prompt of this length ends inside a block, so its fork copies one
PROMPT = chat("Tell me a short story about a fox who learns to read, please.")


@pytest.fixture
def engine(tokenizer) -> Engine:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name="tiny-llama")
    yield engine
    engine.close()


def test_n_samples_use_one_prefill_and_are_reproducible(engine: Engine) -> None:
    ids = engine.encode(PROMPT)
    assert len(ids) % engine.stats()["kv_block_size"]  # a partly filled last block: the copy path runs
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, n=4, logprobs=True)
    before = engine.stats()
    result = engine.generate([PROMPT], params)[0]
    after = engine.stats()
    assert len(result.samples) == 4 and result.token_ids == result.samples[0].token_ids
    assert after["prompt_tokens"] - before["prompt_tokens"] == len(ids)  # the prompt counted (and run) once
    assert after["prefill_passes"] - before["prefill_passes"] == 1
    assert after["forked_samples"] - before["forked_samples"] == 3
    assert len({tuple(s.token_ids) for s in result.samples}) > 1  # distinct seeds, distinct samples
    # the same set again, now packed with other questions: the same bits
    again = engine.generate([QUESTIONS[0], PROMPT, QUESTIONS[2]], [SamplingParams(max_tokens=5), params,
                                                                   SamplingParams(temperature=0, max_tokens=20)])
    assert [(s.token_ids, s.logprobs) for s in again[1].samples] == [(s.token_ids, s.logprobs)
                                                                      for s in result.samples]
    # each sample equals that sample computed alone, from its own prefill, with its derived seed
    for i, sample in enumerate(result.samples):
        solo = engine.generate([PROMPT], SamplingParams(temperature=1.0, seed=sample_seed(7, i), max_tokens=12,
                                                        logprobs=True))[0]
        assert (solo.token_ids, solo.logprobs) == (sample.token_ids, sample.logprobs)
        assert solo.cached_tokens > 0  # (the prefix cache served its prompt: the KV it copies is the same)


def test_sample_zero_keeps_the_seed_and_derived_seeds_are_distinct() -> None:
    assert sample_seed(7, 0) == 7 and sample_seed(None, 3) is None
    assert len({sample_seed(7, i) for i in range(64)}) == 64


def test_n_with_greedy_rows_and_penalties_forks_each_sample_its_own_history(engine: Engine) -> None:
    """Greedy samples are all alike; a penalty then reads each sample's own tokens only."""
    params = SamplingParams(temperature=0, max_tokens=10, n=3, frequency_penalty=1.5)
    result = engine.generate([PROMPT], params)[0]
    single = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, frequency_penalty=1.5))[0]
    assert all(s.token_ids == single.token_ids for s in result.samples)


def test_n_streams_pieces_tagged_with_their_sample(engine: Engine) -> None:
    pieces = []
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10, n=3, logprobs=True)
    result = engine.submit(PROMPT, params, on_text=pieces.append).result(timeout=120)
    for i, sample in enumerate(result.samples):
        assert "".join(p for p in pieces if p.sample_index == i) == sample.text
    with pytest.raises(InvalidRequestError, match="n=3"):
        next(engine.stream(PROMPT, params))


def test_n_with_more_samples_than_free_sequence_slots_queues_the_rest(tokenizer) -> None:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, max_num_seqs=2)
    try:
        params = SamplingParams(temperature=1.0, seed=9, max_tokens=6, n=5)
        result = engine.generate([PROMPT], params)[0]
        for i, sample in enumerate(result.samples):
            solo = engine.generate([PROMPT], SamplingParams(temperature=1.0, seed=sample_seed(9, i),
                                                            max_tokens=6))[0]
            assert solo.token_ids == sample.token_ids
    finally:
        engine.close()


def test_cancelling_an_n_set_cancels_every_sample(engine: Engine) -> None:
    with engine.hold():  # nothing runs until the future is cancelled
        future = engine.submit(PROMPT, SamplingParams(max_tokens=200, n=4))
        assert future.cancel()
    assert engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_cache_bytes"] == 0
