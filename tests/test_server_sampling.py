"""`kev serve`'s sampling fields through stock clients on loopback: the `openai` client and
LangChain's `ChatOpenAI` read logprobs and n choices; penalties, logit_bias and Kev's extras
reach the engine; each bad value is a 400 naming its field. Every server is stopped."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import tiny_model
from server_util import serving

from kev_engine import Engine, SamplingParams
from kev_integrations.server import ServerConfig, build_app

KEY = "k"
MODEL = "tiny"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name=MODEL)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    config = ServerConfig(api_keys=(KEY,), max_queued=16, max_prompts=4, max_tokens_limit=64)
    with serving(build_app(engine, config, model_name=MODEL)) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_chat_logprobs_equal_the_engine(client: openai.OpenAI, engine: Engine) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=3)
    direct = engine.generate([CHAT], SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=3))[0]
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [e.token for e in direct.logprobs]
    assert [c.logprob for c in content] == [e.logprob for e in direct.logprobs]  # JSON floats round-trip exactly
    assert [[a.token for a in c.top_logprobs] for c in content] == [[a.token for a in e.top_logprobs]
                                                                    for e in direct.logprobs]
    assert content[0].bytes == list(content[0].token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_n_choices_seeded_equal_the_engine(client: openai.OpenAI, engine: Engine) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=5, n=3)
    direct = engine.generate([CHAT], SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3))[0]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [s.text for s in direct.samples]
    assert reply.usage.prompt_tokens == direct.prompt_tokens  # the prompt is counted once
    assert reply.usage.completion_tokens == sum(s.completion_tokens for s in direct.samples)


def test_streamed_n_choices_and_logprobs(client: openai.OpenAI, engine: Engine) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=9, n=2,
                                            logprobs=True, stream=True)
    text: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                tokens[choice.index] += [c.token for c in choice.logprobs.content]
    direct = engine.generate([CHAT], SamplingParams(max_tokens=8, temperature=1.0, seed=9, n=2, logprobs=True))[0]
    assert [text[0], text[1]] == [s.text for s in direct.samples]
    assert [tokens[0], tokens[1]] == [[e.token for e in s.logprobs] for s in direct.samples]


def test_completions_logprobs_n_and_penalties(client: openai.OpenAI, engine: Engine) -> None:
    prompts = ["Once upon a time", "The weather today"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0.9, seed=2, n=2,
                                      logprobs=2, frequency_penalty=1.0, presence_penalty=0.5,
                                      extra_body={"min_p": 0.05, "repetition_penalty": 1.2})
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=2, n=2, logprobs=True, top_logprobs=2,
                            frequency_penalty=1.0, presence_penalty=0.5, min_p=0.05, repetition_penalty=1.2)
    direct = engine.generate(prompts, params)
    expected = [s for d in direct for s in d.samples]  # prompt-major: prompt i, sample j → i * n + j
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [s.text for s in expected]
    for choice, sample in zip(reply.choices, expected):
        assert choice.logprobs.token_logprobs == [e.logprob for e in sample.logprobs]
        assert len(choice.logprobs.top_logprobs[0]) <= 2
        assert choice.logprobs.text_offset[0] == 0


def test_logit_bias_and_kev_extras_reach_the_engine(client: openai.OpenAI, engine: Engine) -> None:
    eos = engine.tokenizer.eos_token_id
    forced = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                            logit_bias={str(eos): 100},
                                            extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 5
    free = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    first = engine.generate([CHAT], SamplingParams(max_tokens=5, temperature=0))[0].token_ids[0]
    stopped = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                             extra_body={"stop_token_ids": [first], "min_tokens": 0})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    assert free.usage.completion_tokens >= 1


def test_chat_openai_reads_logprobs_and_n(url: str, engine: Engine) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=url + "/v1", api_key=KEY, model=MODEL, max_tokens=6, temperature=0, max_retries=0)
    message = llm.bind(logprobs=True, top_logprobs=2).invoke("What is the capital of France?")
    direct = engine.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                             SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=2))[0]
    content = message.response_metadata["logprobs"]["content"]
    assert [c["token"] for c in content] == [e.token for e in direct.logprobs]
    assert all(math.isclose(c["logprob"], e.logprob) for c, e in zip(content, direct.logprobs))
    many = ChatOpenAI(base_url=url + "/v1", api_key=KEY, model=MODEL, max_tokens=6, temperature=1.0, seed=3, n=3,
                      max_retries=0)
    result = many.generate([[HumanMessage("Say something.")]])
    assert len(result.generations[0]) == 3


@pytest.mark.parametrize(("endpoint", "body", "param", "words"), [
    ("chat", {"n": 0}, "n", "n=0"),
    ("chat", {"n": 200}, "n", "n=200"),
    ("chat", {"logprobs": "yes"}, "logprobs", "logprobs='yes'"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs=21"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ("chat", {"presence_penalty": 3}, "presence_penalty", "presence_penalty=3"),
    ("chat", {"frequency_penalty": -2.5}, "frequency_penalty", "frequency_penalty=-2.5"),
    ("chat", {"logit_bias": {"12": 150}}, "logit_bias", "logit_bias[12]=150"),
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias", "logit_bias key 'x'"),
    ("chat", {"min_p": 2}, "min_p", "min_p=2"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty=0"),
    ("chat", {"min_tokens": 99}, "min_tokens", "min_tokens=99"),
    ("chat", {"ignore_eos": 1}, "ignore_eos", "ignore_eos=1"),
    ("chat", {"best_of": 2}, "best_of", "best_of=2 is not supported"),
    ("completions", {"logprobs": 21}, "logprobs", "logprobs=21"),
    ("completions", {"logprobs": True}, "logprobs", "logprobs=True"),
    ("completions", {"best_of": 3}, "best_of", "best_of=3 is not supported"),
    ("chat", {"echo": True}, "echo", "echo=True is not supported"),
    ("chat", {"n": 17}, "n", "17 questions"),  # over max_queued=16: it never fits, a 400 (not a 429)
])
def test_bad_sampling_values_are_400_naming_the_field(url: str, endpoint: str, body: dict, param: str,
                                                      words: str) -> None:
    payload = {"model": MODEL, "max_tokens": 8, **body}
    payload.update({"messages": CHAT} if endpoint == "chat" else {"prompt": "Hello"})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    response = httpx.post(url + path, json=payload, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert error["param"] == param, error


def test_a_bad_value_fails_only_its_own_request(url: str, client: openai.OpenAI) -> None:
    response = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                              "logit_bias": {"99999999": 1}},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 400 and "token id 99999999" in json.dumps(response.json())
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0).choices


def test_kev_generate_counts_each_sample_as_a_question_in_flight(url: str) -> None:
    body = {"requests": [{"prompt": "Hello", "sampling": {"n": 17, "max_tokens": 2}}]}  # max_queued=16
    response = httpx.post(url + "/kev/v1/generate", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and "17 questions" in error["message"] and error["param"] == "requests"
    body["requests"][0]["sampling"]["n"] = 16
    response = httpx.post(url + "/kev/v1/generate", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60)
    assert response.status_code == 200 and '"completion"' in response.text
