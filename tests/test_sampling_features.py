"""Per-question sampling features — penalties, logit_bias, min_p, logprobs, stop ids, min_tokens,
ignore_eos — each mixed freely in one pack and isolated: a request's tokens and logprobs are the
same bits packed as alone (the batch-invariant CPU path), and each setting does what its
reference (OpenAI's text, transformers' processors) says."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import QUESTIONS, chat, tiny_model
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from kev_engine import Engine, InvalidRequestError, SamplingParams
from kev_engine.sample import penalties as penalties_mod
from kev_engine.sample.sample import apply_min_p, sample

MIXED = [
    SamplingParams(temperature=0.9, seed=11, max_tokens=10, presence_penalty=1.5, frequency_penalty=0.7,
                   logprobs=True),
    SamplingParams(temperature=0.9, seed=12, max_tokens=10, repetition_penalty=1.6, logprobs=True, top_logprobs=1),
    SamplingParams(temperature=1.0, seed=13, max_tokens=10, min_p=0.2, logprobs=True, top_logprobs=5),
    SamplingParams(temperature=0, max_tokens=10, logit_bias={42: 8.0, 7: -100}, logprobs=True, top_logprobs=20),
    SamplingParams(temperature=0.7, seed=14, max_tokens=10, top_k=40, frequency_penalty=-1.0, logprobs=True),
]


@pytest.fixture
def engine(tokenizer) -> Engine:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name="tiny-llama")
    assert engine.batch_invariant  # the default on CPU: the comparisons below are bitwise
    yield engine
    engine.close()


def _outcome(completion) -> tuple[list[int], list | None]:
    return completion.token_ids, completion.logprobs


def test_mixed_settings_packed_equal_alone_bitwise(engine: Engine) -> None:
    prompts = QUESTIONS[: len(MIXED)]
    packed = engine.generate(prompts + QUESTIONS, MIXED + [SamplingParams(temperature=0, max_tokens=10)] * 5)
    for prompt, params, result in zip(prompts, MIXED, packed):
        alone = engine.generate([prompt], params)[0]
        assert _outcome(result) == _outcome(alone)  # logprob floats compared exactly
    # a control: each row's settings change its outcome (tokens or logprobs), so the equality
    # above would see a row that lost or borrowed a setting in the pack
    for prompt, params, result in zip(prompts, MIXED, packed):
        assert len(result.logprobs) == len(result.token_ids)
        plain = engine.generate([prompt], SamplingParams(temperature=params.temperature, seed=params.seed,
                                                         max_tokens=10, top_k=params.top_k, logprobs=True,
                                                         top_logprobs=params.top_logprobs))[0]
        assert _outcome(plain) != _outcome(result), f"{params} changed nothing: the equality above proves little"


def test_penalised_row_reads_only_its_own_tokens(engine: Engine) -> None:
    """Another row's repeated tokens leave a penalised row's logits alone: the row beside it is
    changed (different prompt, different answer), the penalised one is not, bit for bit."""
    target = SamplingParams(temperature=0.8, seed=5, max_tokens=12, frequency_penalty=2.0,
                            repetition_penalty=1.3, logprobs=True, top_logprobs=3)
    neighbour = SamplingParams(temperature=0, max_tokens=12, frequency_penalty=2.0)
    a = engine.generate([QUESTIONS[0], QUESTIONS[1]], [target, neighbour])
    b = engine.generate([QUESTIONS[0], QUESTIONS[3]], [target, neighbour])
    assert a[1].token_ids != b[1].token_ids  # the neighbour differs...
    assert _outcome(a[0]) == _outcome(b[0])  # ...and the penalised row does not notice


def test_logit_bias_minus_100_never_emits_that_token(engine: Engine) -> None:
    free = engine.generate(QUESTIONS[:3], SamplingParams(temperature=1.0, seed=3, max_tokens=24))
    banned = sorted({t for r in free for t in r.token_ids[:6]})
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, logit_bias={t: -100 for t in banned})
    for result in engine.generate(QUESTIONS[:3], params):
        assert not set(result.token_ids) & set(banned)
    forced = engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=3, logit_bias={"4242": 100}))
    assert forced[0].token_ids == [4242] * 3  # keys as JSON sends them: decimal strings


def test_greedy_logprobs_equal_log_softmax_of_prompt_logits(embedded_engine: Engine) -> None:
    prompt = "The three primary colours are"
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=True, top_logprobs=4)
    result = embedded_engine.generate([prompt], params)[0]
    ids = embedded_engine.encode(prompt)
    full = prompt + embedded_engine.tokenizer.decode(result.token_ids)
    assert embedded_engine.encode(full) == ids + result.token_ids  # the answer re-encodes to the same ids
    logits = embedded_engine.prompt_logits([full])[0]  # [T, V]
    expected = logits[len(ids) - 1: -1].log_softmax(dim=-1)  # the position before each generated token
    for step, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
        assert entry.token_id == token and entry.token == embedded_engine.tokenizer.decode([token])
        assert math.isclose(entry.logprob, expected[step, token].item(), abs_tol=1e-4)
        assert [alt.token_id for alt in entry.top_logprobs] == expected[step].topk(4).indices.tolist()
        assert entry.top_logprobs[0].token_id == token  # greedy: the chosen token is the top one
        assert entry.top_logprobs[0].logprob == entry.logprob


def test_logprobs_describe_the_tempered_penalised_distribution(engine: Engine) -> None:
    """OpenAI's logprobs: after temperature and penalties. At temperature 2 the chosen token's
    logprob is log_softmax(logits / 2); a bias of +5 moves it as a bias of +5 / 2 would."""
    plain = engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=True,
                                                           top_logprobs=20))[0]
    token = plain.token_ids[0]
    logits = engine.prompt_logits([QUESTIONS[0]])[0][-1]
    assert plain.logprobs[0].logprob == logits.log_softmax(-1)[token].item()  # same rows: same bits
    hot = engine.generate([QUESTIONS[0]], SamplingParams(temperature=2.0, seed=1, max_tokens=1, logprobs=True))[0]
    drawn = hot.token_ids[0]
    assert math.isclose(hot.logprobs[0].logprob, (logits / 2).log_softmax(-1)[drawn].item(), abs_tol=1e-5)
    other = plain.logprobs[0].top_logprobs[5].token_id
    biased = engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=True,
                                                            top_logprobs=20, logit_bias={other: 5}))[0]
    shifted = logits.clone()
    shifted[other] += 5
    reported = {alt.token_id: alt.logprob for alt in biased.logprobs[0].top_logprobs}
    assert math.isclose(reported[other], shifted.log_softmax(-1)[other].item(), abs_tol=1e-5)


def test_frequency_penalty_cuts_repetition_on_the_embedded_model(embedded_engine: Engine) -> None:
    prompt = chat("Write a long poem about the sea.")  # greedy, the 135M model loops on "aria of the sea"
    plain, penalised = embedded_engine.generate(
        [prompt, prompt], [SamplingParams(temperature=0, max_tokens=64),
                           SamplingParams(temperature=0, max_tokens=64, frequency_penalty=2.0)])

    def most_repeated(ids: list[int]) -> int:
        return max(ids.count(t) for t in set(ids))

    assert most_repeated(plain.token_ids) >= 8  # the loop the penalty is for (11 times, measured)
    assert most_repeated(penalised.token_ids) < most_repeated(plain.token_ids) / 2


def test_presence_and_frequency_penalty_follow_openai() -> None:
    class Row:
        def __init__(self, sampling, output_ids):
            self.sampling, self.prompt_ids, self.output_ids, self.prompt_set = sampling, [1, 2], output_ids, None

    logits = torch.randn(2, 10)
    rows = [Row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [3, 3, 3, 5]),
            Row(SamplingParams(), [3, 4])]
    out = logits.clone()
    penalties_mod.apply(out, penalties_mod.build(rows, 10, [9], torch.device("cpu")))
    expected = logits.clone()
    expected[0, 3] -= 3 * 0.25 + 0.5  # logit[t] -= count_t * frequency + [count_t > 0] * presence
    expected[0, 5] -= 1 * 0.25 + 0.5
    assert torch.equal(out, expected)  # the second row had no penalty: untouched


def test_repetition_penalty_matches_transformers_over_prompt_and_answer() -> None:
    class Row:
        def __init__(self, sampling, prompt_ids, output_ids):
            self.sampling, self.prompt_ids, self.output_ids, self.prompt_set = sampling, prompt_ids, output_ids, None

    torch.manual_seed(0)
    logits = torch.randn(2, 50) * 3
    rows = [Row(SamplingParams(repetition_penalty=1.7), [1, 2, 7, 7], [9, 2, 30]),
            Row(SamplingParams(repetition_penalty=0.8), [4], [4, 11])]
    out = logits.clone()
    penalties_mod.apply(out, penalties_mod.build(rows, 50, [0], torch.device("cpu")))
    for i, row in enumerate(rows):
        ids = torch.tensor([row.prompt_ids + row.output_ids])
        expected = RepetitionPenaltyLogitsProcessor(row.sampling.repetition_penalty)(ids, logits[i: i + 1].clone())
        assert torch.equal(out[i], expected[0])


def test_greedy_takes_each_rows_first_largest_logit_as_argmax_does() -> None:
    """Greedy rows give argmax's index: the first of tied maxima, a NaN's place, 0 for a row of
    -inf. The control: the ties are real (the last of them is another index)."""
    logits = torch.randn(6, 50_000, generator=torch.Generator().manual_seed(0))
    top = logits.max() + 1
    logits[:, [7, 300, 49_999]] = top  # three tied maxima in every row
    logits[2, 123] = float("nan")
    logits[4] = float("-inf")
    rows = logits.shape[0]
    drawn = sample(logits, temperature=torch.zeros(rows), top_p=torch.ones(rows),
                   top_k=torch.zeros(rows, dtype=torch.long), generators=[None] * rows)
    assert torch.equal(drawn, logits.argmax(dim=-1))
    assert drawn.tolist() == [7, 7, 123, 7, 0, 7]
    assert (logits.shape[1] - 1 - logits.flip(-1).argmax(dim=-1))[0] == 49_999  # control


def test_min_p_keeps_tokens_within_the_ratio_of_the_top_one() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    kept = apply_min_p(logits, torch.tensor([0.5, 0.0]))
    assert torch.isfinite(kept[0]).tolist() == [True, True, False, False]  # 0.15 < 0.5 * 0.5
    assert torch.equal(kept[1], logits[1])  # min_p = 0 passes the row through unchanged


def test_stop_token_ids_min_tokens_and_ignore_eos(engine: Engine) -> None:
    free = engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=12))[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=12,
                                                             stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert stopped.text == engine.tokenizer.decode(free.token_ids[:first], skip_special_tokens=True)
    late = engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                                                          min_tokens=first + 2))[0]
    assert len(late.token_ids) >= first + 2 and stop_at not in late.token_ids[: first + 2]
    eos = engine.tokenizer.eos_token_id
    ends = engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=30,
                                                          logit_bias={eos: 100}))[0]
    assert ends.token_ids == [eos] and ends.finish_reason == "stop"  # a control: eos does end it...
    fixed = engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=30, logit_bias={eos: 100},
                                                           ignore_eos=True))[0]
    assert fixed.token_ids == [eos] * 30 and fixed.finish_reason == "length"  # ...unless ignore_eos
    floor = engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=30, logit_bias={eos: 100},
                                                           min_tokens=5))[0]
    assert len(floor.token_ids) == 6 and eos not in floor.token_ids[:5] and floor.token_ids[5] == eos


def test_grammar_mask_applies_after_biases(engine: Engine) -> None:
    """A bias of +100 cannot bring back a token the constraint forbids."""
    choices = ["yes", "no"]
    tokens = [engine.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("maybe", " Paris", "{")]
    params = SamplingParams(temperature=0, max_tokens=8, choice=choices, logit_bias={t: 100 for t in tokens},
                            frequency_penalty=2.0, logprobs=True, top_logprobs=5)
    result = engine.generate([QUESTIONS[0]], params)[0]
    assert result.text in choices
    for entry in result.logprobs:  # the alternatives are what the grammar allowed
        assert not {alt.token_id for alt in entry.top_logprobs} & set(tokens)


def test_streamed_pieces_carry_their_logprobs(engine: Engine) -> None:
    pieces = []
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=16, logprobs=True, top_logprobs=2)
    result = engine.submit(QUESTIONS[1], params, on_text=pieces.append).result(timeout=120)
    assert "".join(pieces) == result.text
    assert [lp for p in pieces for lp in p.logprobs] == result.logprobs[: sum(len(p.logprobs) for p in pieces)]
    assert all(p.sample_index == 0 for p in pieces)


@pytest.mark.parametrize(("settings", "named"), [
    ({"presence_penalty": 2.5}, "presence_penalty=2.5"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty=nan"),
    ({"repetition_penalty": 0}, "repetition_penalty=0"),
    ({"min_p": 1.5}, "min_p=1.5"),
    ({"logit_bias": {5: 101}}, "logit_bias[5]=101"),
    ({"logit_bias": {"x": 1}}, "logit_bias key 'x'"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs=21"),
    ({"top_logprobs": 3}, "top_logprobs=3 needs logprobs=True"),
    ({"n": 0}, "n=0"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens=50"),
    ({"stop_token_ids": [-1]}, "stop_token_ids=[-1]"),
    ({"ignore_eos": "yes"}, "ignore_eos='yes'"),
])
def test_bad_settings_are_refused_naming_the_value(settings: dict, named: str) -> None:
    with pytest.raises(ValueError, match="not allowed|needs") as raised:
        SamplingParams(**settings)
    assert named in str(raised.value)


def test_token_ids_outside_the_vocabulary_fail_only_their_request(engine: Engine) -> None:
    vocab = len(engine.tokenizer)
    good = SamplingParams(temperature=0, max_tokens=4)
    results = engine.generate(QUESTIONS[:3], [good, SamplingParams(logit_bias={vocab + 5: 1.0}),
                                              SamplingParams(stop_token_ids=[vocab + 9])], return_exceptions=True)
    assert results[0].token_ids == engine.generate([QUESTIONS[0]], good)[0].token_ids
    assert isinstance(results[1], InvalidRequestError) and f"token id {vocab + 5}" in str(results[1])
    assert isinstance(results[2], InvalidRequestError) and f"token id {vocab + 9}" in str(results[2])
