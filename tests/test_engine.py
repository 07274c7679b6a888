"""Engine behaviour around the packed pass: sampling, defaults, stops, scheduling, bad input."""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future

import pytest
import torch
from conftest import QUESTIONS, chat

from kev_engine import Engine, InvalidRequestError, SamplingParams
from kev_engine.inputs.params import Defaults


def test_seeded_sampling_is_independent_of_pack_mates(tiny_engine: Engine) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    alone = tiny_engine.generate([QUESTIONS[0]], seeded)[0]
    mates = [
        SamplingParams(temperature=0.7, max_tokens=5), seeded, SamplingParams(temperature=1.3, seed=9, max_tokens=20)
    ]
    packed = tiny_engine.generate([QUESTIONS[3], QUESTIONS[0], QUESTIONS[1]], mates)[1]
    assert packed.token_ids == alone.token_ids
    other_seed = tiny_engine.generate([QUESTIONS[0]], SamplingParams(temperature=1.0, seed=99, max_tokens=12))[0]
    assert other_seed.token_ids != alone.token_ids  # the seed really drives the draw


def test_temperature_zero_is_greedy_and_mixed_settings_share_one_pass(tiny_engine: Engine) -> None:
    greedy = tiny_engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=8))[0]
    before = tiny_engine.stats()["prefill_passes"]
    mixed = tiny_engine.generate(
        [QUESTIONS[0], QUESTIONS[1]],
        [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=1.5, seed=3, max_tokens=8)],
    )
    assert tiny_engine.stats()["prefill_passes"] == before + 1
    assert mixed[0].token_ids == greedy.token_ids


def test_hot_temperature_update_applies_to_later_packs_only(tiny_engine: Engine, monkeypatch) -> None:
    assert tiny_engine.defaults.temperature == 0.0
    first = tiny_engine.generate(QUESTIONS[:2], SamplingParams(max_tokens=4))
    assert {c.settings_version for c in first} == {0}
    updated = tiny_engine.set_defaults(temperature=0.8)
    assert updated.version == 1 and updated.temperature == 0.8
    second = tiny_engine.generate(QUESTIONS[:2], SamplingParams(max_tokens=4))
    assert {c.settings_version for c in second} == {1}
    with pytest.raises(InvalidRequestError, match="temperature=-1"):
        tiny_engine.set_defaults(temperature=-1)


def test_update_during_a_pack_never_splits_it(tiny_engine: Engine) -> None:
    futures_and_versions = []
    barrier = threading.Barrier(2)

    def updater() -> None:
        barrier.wait()
        for t in (0.3, 0.6, 0.9):
            tiny_engine.set_defaults(temperature=t)

    thread = threading.Thread(target=updater)
    thread.start()
    barrier.wait()
    for _ in range(4):
        results = tiny_engine.generate(QUESTIONS, SamplingParams(max_tokens=2, seed=1))
        futures_and_versions.append({c.settings_version for c in results})
    thread.join()
    assert all(len(versions) == 1 for versions in futures_and_versions)


def test_kev_temperature_env_sets_the_default(monkeypatch) -> None:
    monkeypatch.setenv("KEV_TEMPERATURE", "0.4")
    assert Defaults.from_env().temperature == 0.4
    monkeypatch.setenv("KEV_TEMPERATURE", "warm")
    with pytest.raises(InvalidRequestError, match="KEV_TEMPERATURE='warm'"):
        Defaults.from_env()


def test_stop_strings_cut_the_text(tiny_engine: Engine) -> None:
    free = tiny_engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=20))[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    cut = tiny_engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and free.text.startswith(cut.text)
    assert len(cut.text) == free.text.find(stop)


def test_max_tokens_and_length_finish(tiny_engine: Engine) -> None:
    results = tiny_engine.generate(QUESTIONS[:3], [SamplingParams(max_tokens=n) for n in (1, 3, 7)])
    assert [r.completion_tokens for r in results] == [1, 3, 7]
    assert all(r.finish_reason == "length" for r in results)


def test_eos_finishes_with_stop(tokenizer) -> None:
    from conftest import tiny_model

    model = tiny_model("llama", tokenizer)
    model.lm_head.weight.data[tokenizer.eos_token_id] += 50.0  # make EOS the argmax everywhere
    with_eos_bias = Engine(model, tokenizer)  # the engine packs the weights it starts with
    result = with_eos_bias.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert result.finish_reason == "stop" and result.token_ids == [tokenizer.eos_token_id] and result.text == ""
    with_eos_bias.close()


def test_results_come_back_in_caller_order(tiny_engine: Engine) -> None:
    prompts = [QUESTIONS[4], QUESTIONS[2], QUESTIONS[0]]  # long, short, medium: the scheduler reorders
    packed = tiny_engine.generate(prompts, SamplingParams(max_tokens=5))
    solo = [tiny_engine.generate([p], SamplingParams(max_tokens=5))[0] for p in prompts]
    assert [r.token_ids for r in packed] == [r.token_ids for r in solo]
    assert [r.prompt_tokens for r in packed] == [len(tiny_engine.encode(p)) for p in prompts]


def test_concurrent_submits_coalesce_and_join_running_decodes(tiny_engine: Engine) -> None:
    futures: dict[int, Future] = {}
    before = tiny_engine.stats()

    def ask(i: int) -> None:
        futures[i] = tiny_engine.submit(QUESTIONS[i % 5], SamplingParams(max_tokens=6))

    with tiny_engine.hold():  # no pass starts until every thread has submitted: coalescing without a clock
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()
    results = [futures[i].result(timeout=60) for i in range(6)]
    assert all(r.completion_tokens == 6 for r in results)
    assert tiny_engine.stats()["prefill_passes"] == before["prefill_passes"] + 1  # all six in one pack
    # a question submitted while another decodes joins its decode steps (continuous batching)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    with tiny_engine.hold():
        long_running = tiny_engine.submit(QUESTIONS[0], SamplingParams(max_tokens=40))
        tiny_engine.step()  # its prefill
        tiny_engine.step()  # a decode step
        late = tiny_engine.submit(QUESTIONS[1], greedy)
        before = tiny_engine.stats()
        tiny_engine.step()  # the late prefill and the running decode share this pass
        after = tiny_engine.stats()
        assert after["forward_passes"] == before["forward_passes"] + 1 and after["running"] == 2
        assert after["prefill_passes"] == before["prefill_passes"] + 1
        # a prefill pass (the counters are disjoint) that also drew the running answer's next token
        assert after["decode_steps"] == before["decode_steps"]
        assert after["generated_tokens"] == before["generated_tokens"] + 2
    assert late.result(timeout=60).completion_tokens == 3 and long_running.result(timeout=60).completion_tokens == 40
    assert late.result().token_ids == tiny_engine.generate([QUESTIONS[1]], greedy)[0].token_ids


def test_empty_batch_and_one_token_prompt(tiny_engine: Engine) -> None:
    assert tiny_engine.generate([]) == []
    one = tiny_engine.tokenizer.decode([tiny_engine.encode("hello")[0]])
    assert len(tiny_engine.encode(one)) == 1
    result = tiny_engine.generate([one], SamplingParams(max_tokens=3))[0]
    assert result.prompt_tokens == 1 and result.completion_tokens == 3


# ---- bad input: a clear error naming the value, failing only its own request -----------------

BAD_SAMPLING = [
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(temperature=math.nan), "temperature=nan"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(max_tokens=0), "max_tokens=0"),
    (dict(stop=[""]), "stop="),
    (dict(seed="x"), "seed='x'"),
]


@pytest.mark.parametrize("kwargs, named", BAD_SAMPLING)
def test_bad_sampling_settings_name_the_value(kwargs, named) -> None:
    with pytest.raises(InvalidRequestError, match=named.replace("(", r"\(").replace("[", r"\[")):
        SamplingParams(**kwargs)


def test_unknown_sampling_keys_are_named() -> None:
    with pytest.raises(InvalidRequestError, match=r"\['temprature'\].*allowed: \['temperature'"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_bad_prompts_are_refused_with_clear_errors(tiny_engine: Engine) -> None:
    too_long = "word " * 2000  # the tiny model's context is 1024 tokens
    cases = [("", "empty"), ("   ", "empty"), ([], "empty"), (too_long, "context is 1024"),
             ([{"content": "no role"}], "not a chat message"), (42, "type int")]
    for prompt, named in cases:
        with pytest.raises(InvalidRequestError, match=named):
            tiny_engine.generate([prompt])
    with pytest.raises(InvalidRequestError, match="list of prompts"):
        tiny_engine.generate("a bare string")
    with pytest.raises(InvalidRequestError, match="2 sampling settings for 3 prompts"):
        tiny_engine.generate(QUESTIONS[:3], [SamplingParams(), SamplingParams()])


def test_a_bad_request_fails_alone(tiny_engine: Engine) -> None:
    prompts = [QUESTIONS[0], "", QUESTIONS[1], QUESTIONS[2]]
    settings = [SamplingParams(max_tokens=4), None, {"temperature": -1}, {"max_tokens": 4}]
    results = tiny_engine.generate(prompts, settings, return_exceptions=True)
    assert isinstance(results[1], InvalidRequestError) and "empty" in str(results[1])
    assert isinstance(results[2], InvalidRequestError) and "temperature=-1" in str(results[2])
    assert results[0].completion_tokens == 4 and results[3].completion_tokens == 4
    with pytest.raises(InvalidRequestError):
        tiny_engine.generate(prompts, settings)  # without return_exceptions: raises before running
    failed = tiny_engine.submit("", None)
    fine = tiny_engine.submit(QUESTIONS[0], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        failed.result()
    assert fine.result().completion_tokens == 2


def test_stats_count_requests_passes_and_tokens(tiny_engine: Engine) -> None:
    results = tiny_engine.generate(QUESTIONS[:3], SamplingParams(max_tokens=4))
    stats = tiny_engine.stats()
    assert stats["requests"] == 3 and stats["prefill_passes"] == 1 and stats["decode_steps"] == 3
    assert stats["prompt_tokens"] == sum(r.prompt_tokens for r in results)
    assert stats["generated_tokens"] == 12


def test_closed_engine_refuses_new_work(tokenizer) -> None:
    from conftest import tiny_model

    engine = Engine(tiny_model("llama", tokenizer), tokenizer)
    engine.generate([QUESTIONS[0]], SamplingParams(max_tokens=2))
    engine.close()
    with pytest.raises(Exception, match="closed"):
        engine.submit(QUESTIONS[0])


# ---- streaming and cancellation ------------------------------------------------------------------


def test_stream_pieces_add_up_to_the_answer(tiny_engine: Engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=15)
    whole = tiny_engine.generate([QUESTIONS[0]], params)[0].text
    pieces = list(tiny_engine.stream(QUESTIONS[0], params))
    assert len(pieces) > 1 and "".join(pieces) == whole


def test_stream_never_shows_a_stop_string(tiny_engine: Engine) -> None:
    free = tiny_engine.generate([QUESTIONS[0]], SamplingParams(temperature=0, max_tokens=20))[0].text
    stop = free[5:8]
    cut = SamplingParams(temperature=0, max_tokens=20, stop=[stop])
    streamed = "".join(tiny_engine.stream(QUESTIONS[0], cut))
    assert streamed == free[: free.find(stop)] and stop not in streamed


def test_cancelling_a_running_request_leaves_the_others_answered(tiny_engine: Engine) -> None:
    started = threading.Event()
    long_one = tiny_engine.submit(QUESTIONS[0], SamplingParams(max_tokens=200), on_text=lambda _: started.set())
    others = [tiny_engine.submit(q, SamplingParams(temperature=0, max_tokens=30)) for q in QUESTIONS[1:4]]
    assert started.wait(30)
    assert long_one.cancel()  # running requests stay cancellable
    answers = [f.result() for f in others]
    assert all(a.completion_tokens == 30 for a in answers)
    solo = tiny_engine.generate(QUESTIONS[1:4], SamplingParams(temperature=0, max_tokens=30))
    assert [a.token_ids for a in answers] == [s.token_ids for s in solo]
    stats = tiny_engine.stats()
    assert stats["cancelled"] == 1 and stats["running"] == 0
    assert stats["generated_tokens"] < 200 + 6 * 30  # the cancelled one stopped early


def test_cancelling_a_waiting_request_never_computes_it(tokenizer) -> None:
    from conftest import tiny_model

    engine = Engine(tiny_model("llama", tokenizer), tokenizer, max_num_seqs=1, max_batch_tokens=64)
    first = engine.submit(QUESTIONS[0], SamplingParams(max_tokens=20))
    queued = engine.submit(QUESTIONS[1], SamplingParams(max_tokens=20))
    assert queued.cancel()
    assert first.result().completion_tokens == 20
    assert engine.stats()["requests"] == 2 and engine.stats()["generated_tokens"] == 20
    engine.close()


def test_dict_prompt_hands_tools_to_the_chat_template(tiny_engine: Engine) -> None:
    seen = {}
    template = tiny_engine.tokenizer.apply_chat_template

    def spy(messages, **kwargs):
        seen.update(kwargs)
        return template(messages, **kwargs)

    tiny_engine.tokenizer.apply_chat_template = spy
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    try:
        ids = tiny_engine.encode({"messages": QUESTIONS[0], "tools": tools})
    finally:
        del tiny_engine.tokenizer.apply_chat_template
    assert seen["tools"] == tools and ids == tiny_engine.encode(QUESTIONS[0])  # this template ignores tools
    with pytest.raises(InvalidRequestError, match="'messages' \\(required\\) and 'tools'"):
        tiny_engine.encode({"msgs": QUESTIONS[0]})


def test_a_failing_stream_callback_fails_only_its_request(tiny_engine: Engine) -> None:
    def broken(_: str) -> None:
        raise RuntimeError("listener went away")

    bad = tiny_engine.submit(QUESTIONS[0], SamplingParams(max_tokens=20), on_text=broken)
    good = tiny_engine.submit(QUESTIONS[1], SamplingParams(max_tokens=20))
    with pytest.raises(RuntimeError, match="listener went away"):
        bad.result()
    assert good.result().completion_tokens == 20


def test_generate_with_logits_gives_the_logits_each_token_was_drawn_from(tiny_engine: Engine) -> None:
    prompt = chat("What is the capital of France?")
    ((completion, logits),) = tiny_engine.generate_with_logits([prompt], SamplingParams(temperature=0, max_tokens=4))
    assert logits.dtype == torch.float32 and logits.shape[0] == len(completion.token_ids) == 4
    assert logits.argmax(-1).tolist() == completion.token_ids  # greedy: each token is its row's top
    again = tiny_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0]
    assert (again.text, again.token_ids) == (completion.text, completion.token_ids)
    with pytest.raises(InvalidRequestError, match="n=2 is not allowed with generate_with_logits"):
        tiny_engine.generate_with_logits([prompt], SamplingParams(n=2, max_tokens=2))


def test_a_penalised_row_never_writes_into_the_logits_its_pack_mates_capture(tiny_engine: Engine) -> None:
    """Sampling reads a pass's logits in place where nothing penalises or masks them, and copies the
    rows otherwise: a biased question's captured logits are the raw ones, and so are its plain pack
    mate's. Control: the bias does change what the biased question draws."""
    prompt = chat("What is the capital of France?")
    greedy = SamplingParams(temperature=0, max_tokens=3)
    ((alone, raw),) = tiny_engine.generate_with_logits([prompt], greedy)
    banned = alone.token_ids[0]
    biased = SamplingParams(temperature=0, max_tokens=3, logit_bias={banned: -100})
    (plain, plain_logits), (steered, steered_logits) = tiny_engine.generate_with_logits([prompt, prompt],
                                                                                       [greedy, biased])
    assert steered.token_ids[0] != banned  # the control: the bias is applied to what it draws from
    assert plain.token_ids == alone.token_ids and torch.equal(plain_logits, raw)
    assert torch.equal(steered_logits[0], raw[0])  # its first row as the model gave it, unbiased


def test_a_token_id_prompt_is_fed_as_given(tiny_engine: Engine) -> None:
    """{"prompt_token_ids": ids} (vLLM's TokensPrompt shape): the same answer as the text those ids
    encode, fed without re-tokenizing; a bad id fails its own request, naming its position."""
    text = "The capital of France is"
    ids = tiny_engine.encode(text)
    greedy = SamplingParams(max_tokens=5, temperature=0)
    by_ids, by_text = tiny_engine.generate([{"prompt_token_ids": ids}, text], greedy)
    assert by_ids.token_ids == by_text.token_ids and by_ids.prompt_tokens == len(ids)
    assert tiny_engine.encode({"prompt_token_ids": ids[1:]}) == ids[1:]  # not what the text would give: as sent
    bad = tiny_engine.generate([{"prompt_token_ids": [ids[0], -3]}, text], greedy, return_exceptions=True)
    assert isinstance(bad[0], InvalidRequestError) and "prompt_token_ids[1]=-3" in str(bad[0])
    assert bad[1].token_ids == by_text.token_ids


def test_prompt_logprobs_are_the_prompt_logits_read_at_each_next_token(tiny_engine: Engine) -> None:
    """vLLM's prompt_logprobs (what OpenAI's echo and lm-eval's loglikelihood read): token t + 1's
    logprob is row t of the prompt's logits, log-softmaxed; the first token has none."""
    prompts = ["The river rose after three days", "Once upon a time"]
    answers = tiny_engine.prompt_logprobs(prompts, top_logprobs=2)
    for prompt, answer, rows in zip(prompts, answers, tiny_engine.prompt_logits(prompts)):
        ids = tiny_engine.encode(prompt)
        expected = rows.log_softmax(dim=-1)
        assert answer.first_token == tiny_engine.tokenizer.decode([ids[0]])
        assert [lp.token_id for lp in answer.logprobs] == ids[1:]
        assert [lp.logprob for lp in answer.logprobs] == [expected[t, ids[t + 1]].item() for t in range(len(ids) - 1)]
        assert all(len(lp.top_logprobs) == 2 for lp in answer.logprobs)
    with pytest.raises(InvalidRequestError, match=r"top_logprobs=21 is not allowed; use an integer in \[0, 20\]"):
        tiny_engine.prompt_logprobs(prompts, top_logprobs=21)
