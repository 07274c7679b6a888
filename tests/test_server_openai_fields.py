"""OpenAI's and vLLM's request fields beyond the basics, on the real app over loopback with a tiny
random-weight model: ``GET /v1/models/{id}``, token-id prompts, ``echo`` (with the prompt's
logprobs, as lm-eval's loglikelihood asks), vLLM's guided fields and ``structured_outputs``, and
``stream_options.continuous_usage_stats``. Each refusal is a 400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from conftest import make_adapter, tiny_model
from server_util import serving

from kev_engine import Engine, SamplingParams
from kev_integrations.server import ServerConfig, build_app

MODEL = "tiny"
ADAPTER = "sql"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is Paris, and the capital of Spain is"


@pytest.fixture(scope="module")
def engine(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model = tiny_model("llama", tokenizer)
    folder = make_adapter(model, tmp_path_factory.mktemp("adapter") / ADAPTER, seed=2)
    engine = Engine(model, tokenizer, name=MODEL)
    engine.load_adapter(ADAPTER, str(folder))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with serving(build_app(engine, ServerConfig(max_tokens_limit=64), model_name=MODEL)) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)


def refused(response: httpx.Response, param: str, *words: str) -> None:
    """`response` is a 400 in OpenAI's shape naming `param`, its message holding each of `words`."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for word in words:
        assert word in error["message"], error


# ---- GET /v1/models/{id} ----------------------------------------------------------------------


def test_each_listed_model_is_retrieved_by_its_id(client: openai.OpenAI) -> None:
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    assert list(listed) == [MODEL, ADAPTER]
    for model_id, card in listed.items():
        assert client.models.retrieve(model_id).model_dump() == card
    assert listed[ADAPTER]["parent"] == MODEL and listed[MODEL]["parent"] is None


def test_an_unknown_model_id_is_404_model_not_found(client: openai.OpenAI, url: str) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.body["code"] == "model_not_found"
    raw = httpx.get(url + "/v1/models/org/gpt-4", timeout=60)  # an id with a slash is still one id
    assert raw.status_code == 404
    error = raw.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_not_found" and error["param"] == "model" and "'org/gpt-4'" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_unknown_model_is_404_model_not_found_where_answers_are_asked(client: openai.OpenAI, url: str,
                                                                          path: str) -> None:
    """As OpenAI and vLLM answer, and as /v1/models/{id} does: the `openai` client's `NotFoundError`."""
    ask = client.chat.completions.create if path == "/v1/chat/completions" else client.completions.create
    body = {"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": PROMPT}
    with pytest.raises(openai.NotFoundError) as caught:
        ask(model="gpt-4", max_tokens=2, **body)
    assert caught.value.body["code"] == "model_not_found"
    raw = post(url, path, {**body, "model": "org/gpt-4", "max_tokens": 2})
    assert raw.status_code == 404, raw.text
    error = raw.json()["error"]
    assert error == {"message": f"the model 'org/gpt-4' does not exist here; served: {[MODEL, ADAPTER]}",
                     "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert error == httpx.get(url + "/v1/models/org/gpt-4", timeout=60).json()["error"]  # the same shape
    assert ask(model=ADAPTER, max_tokens=2, **body).usage.completion_tokens == 2  # a served name still answers


# ---- token-id prompts -------------------------------------------------------------------------


def test_a_token_id_prompt_is_answered_as_its_text(client: openai.OpenAI, engine: Engine) -> None:
    texts = ["Once upon a time", "The capital of France is"]
    ids = [engine.encode(text) for text in texts]
    by_text = client.completions.create(model=MODEL, prompt=texts[0], max_tokens=6)
    by_ids = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids[0]) == by_text.usage.prompt_tokens
    several = client.completions.create(model=MODEL, prompt=ids, max_tokens=6)
    strings = client.completions.create(model=MODEL, prompt=texts, max_tokens=6)
    assert [c.text for c in several.choices] == [c.text for c in strings.choices]
    assert several.usage.prompt_tokens == sum(len(i) for i in ids)


def test_a_list_may_mix_text_and_token_id_prompts(url: str, engine: Engine) -> None:
    mixed = post(url, "/v1/completions", {"prompt": ["Once upon a time", engine.encode("Rain in Spain")],
                                          "max_tokens": 4}).json()
    texts = post(url, "/v1/completions", {"prompt": ["Once upon a time", "Rain in Spain"], "max_tokens": 4}).json()
    assert [c["text"] for c in mixed["choices"]] == [c["text"] for c in texts["choices"]]


@pytest.mark.parametrize(("prompt", "words"), [
    ([[1, 2], [5, 99_999_999]], ["prompt[1][1]=99999999 is not a token id", "0..49151"]),
    ([3, -1], ["prompt[1]=-1 is not a token id"]),
    ([], ["prompt is an empty list"]),
    ([[1, 2], []], ["prompt[1] is an empty list"]),
    ([1, "two"], ["prompt[0] is an int"]),  # neither ids nor a list of prompts
    ([[1, True]], ["prompt[0] is a list mixing token ids"]),
    ([[1, 2.5]], ["prompt[0] is a list mixing token ids"]),
    (None, ["prompt is missing"]),
    ({"ids": [1]}, ["prompt is a dict"]),
])
def test_malformed_prompts_are_400_naming_the_prompt(url: str, prompt: Any, words: list[str]) -> None:
    refused(post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2}), "prompt", *words)


def test_token_ids_are_fed_exactly_as_sent(client: openai.OpenAI, engine: Engine, tokenizer: Any) -> None:
    """"hello" spelled letter by letter: ids this tokenizer would never make of that text (it makes
    one token of it). They are fed as sent — lm-eval scores its own tokens — and the echo's
    logprobs are of exactly those tokens; the text "hello" (the control) is other tokens."""
    letters = [tokenizer.convert_tokens_to_ids(c) for c in "hello"]
    assert tokenizer("hello")["input_ids"] != letters
    echoed = client.completions.create(model=MODEL, prompt=letters, max_tokens=0, echo=True, logprobs=1)
    assert echoed.usage.prompt_tokens == 5 and echoed.choices[0].logprobs.tokens == list("hello")
    rows = engine.prompt_logits([{"prompt_token_ids": letters}])[0].log_softmax(dim=-1)
    assert echoed.choices[0].logprobs.token_logprobs[1:] == [rows[j - 1, letters[j]].item() for j in range(1, 5)]
    as_text = client.completions.create(model=MODEL, prompt="hello", max_tokens=0, echo=True, logprobs=1)
    assert as_text.usage.prompt_tokens != 5


# ---- echo -------------------------------------------------------------------------------------


def expected_logprobs(engine: Engine, prompt: str) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and the model's log-probabilities at each position ([len, vocab])."""
    return engine.encode(prompt), engine.prompt_logits([prompt])[0].log_softmax(dim=-1)


def test_echo_prepends_the_prompt_to_each_choice(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "Once upon a time"]
    plain = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5)
    echoed = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, echo=True)
    assert [c.text for c in echoed.choices] == [p + c.text for p, c in zip(prompts, plain.choices)]
    assert echoed.usage == plain.usage


def test_echo_with_max_tokens_0_gives_the_prompts_logprobs_as_lm_eval_reads_them(
        client: openai.OpenAI, engine: Engine) -> None:
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = reply.choices[0]
    ids, logprobs = expected_logprobs(engine, PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0
    got = choice.logprobs
    assert "".join(got.tokens) == PROMPT and len(got.tokens) == len(ids)
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None  # nothing precedes the first token
    # row t - 1 is the distribution of token t: each value is the model's own, bit for bit
    assert got.token_logprobs[1:] == [logprobs[t - 1, ids[t]].item() for t in range(1, len(ids))]
    for t in range(1, len(ids)):
        best = logprobs[t - 1].max().item()
        assert list(got.top_logprobs[t].values()) == [best]  # lm-eval's is_greedy: token == max(top)
    assert got.text_offset[:3] == [0, len(got.tokens[0]), len(got.tokens[0]) + len(got.tokens[1])]


def test_a_prompts_logprobs_are_the_same_alone_and_packed(url: str, engine: Engine) -> None:
    assert engine.batch_invariant, "this test checks Kev's promise where it is made: a batch-invariant engine"

    def prompt_logprobs(prompts: list[str]) -> list[dict[str, Any]]:
        body = {"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 3}
        return [c["logprobs"] for c in post(url, "/v1/completions", body).json()["choices"]]

    alone = prompt_logprobs([PROMPT])[0]
    before = engine.stats()["forward_passes"]
    packed = prompt_logprobs(["Once upon a time there was", PROMPT, "def fibonacci(n):\n    return"])[1]
    assert engine.stats()["forward_passes"] == before + 1  # the three prompts shared one pass
    assert packed["token_logprobs"] == alone["token_logprobs"]  # exact float equality, not a tolerance
    assert packed["top_logprobs"] == alone["top_logprobs"]
    # the control: the same words after one changed one — the comparison above can fail
    other = prompt_logprobs([PROMPT.replace("France", "Italy")])[0]
    assert len(other["token_logprobs"]) == len(alone["token_logprobs"])
    assert other["token_logprobs"][-1] != alone["token_logprobs"][-1]


def test_echo_with_generation_puts_the_prompts_logprobs_before_the_answers(
        client: openai.OpenAI, engine: Engine) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2).choices[0]
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2, echo=True).choices[0]
    ids, _ = expected_logprobs(engine, PROMPT)
    assert "".join(echoed.logprobs.tokens[:len(ids)]) == PROMPT
    assert echoed.logprobs.tokens[len(ids):] == plain.logprobs.tokens
    assert echoed.text == PROMPT + plain.text
    assert echoed.logprobs.token_logprobs[len(ids):] == plain.logprobs.token_logprobs
    assert echoed.logprobs.top_logprobs[len(ids):] == plain.logprobs.top_logprobs
    assert all(len(top) == 2 for top in echoed.logprobs.top_logprobs[1:len(ids)])
    # the answer's offsets count from where the prompt's text ends
    assert echoed.logprobs.text_offset[len(ids):] == [len(PROMPT) + o for o in plain.logprobs.text_offset]


def test_echo_takes_token_id_prompts_and_n(client: openai.OpenAI, engine: Engine) -> None:
    ids = engine.encode(PROMPT)
    reply = client.completions.create(model=MODEL, prompt=[ids], max_tokens=0, echo=True, n=2, logprobs=0)
    assert [c.text for c in reply.choices] == [PROMPT, PROMPT]
    assert reply.choices[0].logprobs == reply.choices[1].logprobs
    assert reply.choices[0].logprobs.top_logprobs[1] == {}  # logprobs=0: the token's own, no alternatives


def test_echo_of_an_adapter_uses_the_adapters_logprobs(url: str, engine: Engine) -> None:
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0}
    base = post(url, "/v1/completions", body).json()["choices"][0]["logprobs"]["token_logprobs"]
    adapted = post(url, "/v1/completions", {**body, "model": ADAPTER}).json()["choices"][0]["logprobs"]
    ids = engine.encode(PROMPT)
    expected = engine.prompt_logits([PROMPT], ADAPTER)[0].log_softmax(dim=-1)
    assert adapted["token_logprobs"][1:] == [expected[t - 1, ids[t]].item() for t in range(1, len(ids))]
    assert adapted["token_logprobs"] != base


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens", ["max_tokens=0", "echo=true"]),
    ({"prompt": PROMPT, "max_tokens": 2, "echo": True, "stream": True}, "echo", ["stream=true"]),
    ({"prompt": PROMPT, "max_tokens": 2, "echo": "yes"}, "echo", ["echo='yes'"]),
    ({"prompt": [1, 99_999_999], "max_tokens": 0, "echo": True}, "prompt", ["prompt[1]=99999999"]),
])
def test_echo_refusals_name_the_field(url: str, body: dict[str, Any], param: str, words: list[str]) -> None:
    refused(post(url, "/v1/completions", body), param, *words)


def test_chat_still_refuses_echo(url: str) -> None:
    refused(post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "echo": True}), "echo",
            "echo=True is not supported")


# ---- vLLM's guided fields and structured_outputs -------------------------------------------------

CHOICES = ["yes", "no", "maybe"]


def direct(engine: Engine, prompt: Any, **constraint: Any) -> str:
    return engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, **constraint))[0].text


@pytest.mark.parametrize(("fields", "setting"), [
    ({"guided_choice": CHOICES}, {"choice": CHOICES}),
    ({"structured_outputs": {"choice": CHOICES}}, {"choice": CHOICES}),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, {"regex": "[0-9]{3}-[a-z]{2}"}),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, {"regex": "[0-9]{3}-[a-z]{2}"}),
    ({"guided_grammar": 'root ::= "ok" | "fine" [0-9]'}, {"grammar": 'root ::= "ok" | "fine" [0-9]'}),
    ({"structured_outputs": {"grammar": 'root ::= "ok" | "fine" [0-9]'}}, {"grammar": 'root ::= "ok" | "fine" [0-9]'}),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
     {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'},
     {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_guided_fields_constrain_the_reply_as_the_engine_setting_does(
        url: str, engine: Engine, endpoint: str, fields: dict[str, Any], setting: dict[str, Any]) -> None:
    if endpoint == "chat":
        body, prompt, path = {"messages": CHAT}, CHAT, "/v1/chat/completions"
    else:
        body, prompt, path = {"prompt": PROMPT}, PROMPT, "/v1/completions"
    reply = post(url, path, {**body, **fields, "max_tokens": 24, "temperature": 0})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    assert text == direct(engine, prompt, **setting)  # the same constraint the engine applies itself
    if "choice" in setting:
        assert text in CHOICES
    if "regex" in setting:
        assert re.fullmatch(setting["regex"], text)
    if "grammar" in setting:
        assert re.fullmatch(r"ok|fine[0-9]", text)
    if choice["finish_reason"] == "stop" and ("json_schema" in setting or "json_object" in setting):
        assert isinstance(json.loads(text), dict)  # a random-weight model may run out of tokens first


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/completions", {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
     "guided_json", ["response_format and guided_json both constrain the reply"]),
    ("/v1/chat/completions", {"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice",
     ["guided_regex and guided_choice"]),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice",
     ["structured_outputs.regex and structured_outputs.choice"]),
    ("/v1/completions", {"guided_grammar": 'root ::= "a"', "structured_outputs": {"json_object": True}},
     "structured_outputs.json_object", ["guided_grammar and structured_outputs.json_object"]),
    ("/v1/chat/completions", {"guided_regex": "a", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "guided_regex", ["give tools or guided_regex, not both"]),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", ["guided_json is not valid JSON"]),
    ("/v1/completions", {"guided_json": [1]}, "guided_json", ["use a JSON schema"]),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", ["non-empty list of non-empty strings"]),
    ("/v1/completions", {"guided_regex": ""}, "guided_regex", ["non-empty string"]),
    ("/v1/completions", {"guided_grammar": "root ::= ("}, "guided_grammar", ["could not be compiled"]),
    ("/v1/completions", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     ["not supported by Kev"]),
    ("/v1/completions", {"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object",
     ["use true"]),
    ("/v1/completions", {"structured_outputs": "json"}, "structured_outputs", ["use an object"]),
])
def test_guided_refusals_name_the_fields(url: str, path: str, body: dict[str, Any], param: str,
                                         words: list[str]) -> None:
    base = {"messages": CHAT} if "chat" in path else {"prompt": PROMPT}
    refused(post(url, path, {**base, **body, "max_tokens": 4}), param, *words)


def test_structured_outputs_keys_left_off_change_nothing(url: str, engine: Engine) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "structured_outputs": {"choice": CHOICES, "json": None,
                                                                      "json_object": False,
                                                                      "disable_any_whitespace": False}}
    reply = post(url, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == direct(engine, PROMPT, choice=CHOICES)


# ---- stream_options.continuous_usage_stats ------------------------------------------------------


def events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of one streamed response, up to ``[DONE]``."""
    with httpx.stream("POST", url + path, json={"model": MODEL, "stream": True, **body}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_every_streamed_chat_chunk_carries_the_usage_so_far(client: openai.OpenAI, engine: Engine) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 12
    with_choices = chunks[:-1]
    prompt_tokens = len(engine.encode(CHAT))
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == final.usage.completion_tokens
    assert {c.usage.prompt_tokens for c in with_choices} == {prompt_tokens} == {final.usage.prompt_tokens}
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in with_choices)
    assert all(c.choices[0].logprobs is None for c in with_choices)  # counted by logprobs, never shown unasked


def test_continuous_usage_is_per_choice_on_completions(url: str, engine: Engine) -> None:
    prompts = ["Once upon a time", PROMPT]
    body = {"prompt": prompts, "max_tokens": 6, "n": 2, "ignore_eos": True, "logprobs": 1,
            "stream_options": {"continuous_usage_stats": True}}
    chunks = events(url, "/v1/completions", body)
    assert all("usage" in c for c in chunks) and len(chunks) > 4  # no include_usage: no closing usage chunk
    for index in range(4):  # prompt i, sample j: choice i * 2 + j
        own = [c for c in chunks if c["choices"][0]["index"] == index]
        assert {c["usage"]["prompt_tokens"] for c in own} == {len(engine.encode(prompts[index // 2]))}
        assert own[-1]["usage"]["completion_tokens"] == 6 and own[-1]["choices"][0]["finish_reason"] == "length"
        shown = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in own if c["choices"][0]["logprobs"])
        assert shown == 6  # asked-for logprobs still reach the client, each token's once


def test_without_continuous_usage_chunks_carry_no_usage(url: str) -> None:
    chunks = events(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6,
                                                  "stream_options": {"include_usage": True}})
    assert [("usage" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_bad_stream_options_are_400(url: str) -> None:
    refused(post(url, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stream": True,
                                               "stream_options": {"continuous_usage_stats": "yes"}}),
            "stream_options.continuous_usage_stats", "use true or false")
