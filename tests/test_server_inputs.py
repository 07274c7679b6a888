"""Loose input is refused by name: chat roles outside OpenAI's five, tool replies to no call made,
and stop lists past the engine's limit — on the real app over loopback for every endpoint that
takes them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import tiny_model
from server_util import serving

from kev_engine import Engine, InvalidRequestError, SamplingParams
from kev_engine.inputs.params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from kev_integrations.server import ServerConfig, build_app

MODEL = "tiny"
ALLOWED = ["system", "developer", "user", "assistant", "tool"]


@pytest.fixture(scope="module")
def url(tokenizer: Any) -> Iterator[str]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name=MODEL)
    with serving(build_app(engine, ServerConfig(max_tokens_limit=64), model_name=MODEL)) as base:
        yield base
    engine.close()


def test_stop_lists_are_bounded_in_count_and_in_size() -> None:
    assert len(SamplingParams(stop=["s"] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS
    assert SamplingParams(stop="x" * MAX_STOP_CHARS).stop == ("x" * MAX_STOP_CHARS,)
    with pytest.raises(InvalidRequestError, match=rf"stop=\[5000 strings\].*at most {MAX_STOP_STRINGS} stop strings"):
        SamplingParams(stop=[f"s{i}" for i in range(5000)])
    with pytest.raises(InvalidRequestError, match=rf"stop=\[{MAX_STOP_CHARS + 1} characters.*{MAX_STOP_CHARS}"):
        SamplingParams(stop=["x" * MAX_STOP_CHARS, "y"])


def test_a_role_outside_the_five_is_400_naming_it_and_the_allowed_ones(url: str) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "alien", "content": "take me to your leader"}]
    response = httpx.post(url + "/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[1].role" and error["type"] == "invalid_request_error"
    assert "role='alien'" in error["message"] and str(ALLOWED) in error["message"]


def call(call_id: str, name: str = "get_weather") -> dict[str, Any]:
    """One tool call of an assistant message, in OpenAI's shape."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": '{"city": "Paris"}'}}


def chat(url: str, messages: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": messages, "max_tokens": 2})


def test_every_allowed_role_is_answered(url: str) -> None:
    extra = {"assistant": {"tool_calls": [call("call_1")]}, "tool": {"tool_call_id": "call_1"}}
    messages = [{"role": role, "content": f"a {role} turn", **extra.get(role, {})}
                for role in ALLOWED] + [{"role": "user", "content": "and now?"}]
    response = httpx.post(url + "/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_a_tool_reply_to_no_call_made_is_400_naming_its_id_and_the_calls(url: str) -> None:
    asked = {"role": "user", "content": "Weather in Paris and Rome?"}
    calls = {"role": "assistant", "content": "", "tool_calls": [call("call_a"), call("call_b")]}
    stray = {"role": "tool", "tool_call_id": "call_zzz", "content": "Sunny"}
    response = chat(url, [asked, calls, {"role": "tool", "tool_call_id": "call_a", "content": "Sunny"}, stray])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[3].tool_call_id" and error["type"] == "invalid_request_error"
    assert "'call_zzz'" in error["message"] and "['call_a', 'call_b']" in error["message"]
    early = chat(url, [asked, {"role": "tool", "tool_call_id": "call_a", "content": "Sunny"}, calls])
    assert early.status_code == 400 and early.json()["error"]["param"] == "messages[1].tool_call_id"
    assert "no earlier assistant message made a tool call" in early.json()["error"]["message"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="'call_zzz' answers no tool call") as caught:
        client.chat.completions.create(model=MODEL, messages=[asked, calls, stray], max_tokens=2)
    assert caught.value.body["param"] == "messages[2].tool_call_id"


def test_tool_replies_to_calls_made_are_answered_whichever_turn_made_them(url: str) -> None:
    """Two calls in one message, answered out of order, and one of them only after a later round."""
    first = {"role": "assistant", "content": "", "tool_calls": [call("call_a"), call("call_b", "get_time")]}
    second = {"role": "assistant", "content": "", "tool_calls": [call("call_c")]}
    messages = [{"role": "user", "content": "Weather and time in Paris?"}, first,
                {"role": "tool", "tool_call_id": "call_b", "content": "12:00"}, second,
                {"role": "tool", "tool_call_id": "call_c", "content": "Sunny"},
                {"role": "tool", "tool_call_id": "call_a", "content": "Sunny, 24 C"}]
    response = chat(url, messages)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_too_many_stop_strings_are_400_naming_the_limit(url: str, path: str, body: dict[str, Any]) -> None:
    response = httpx.post(url + path, timeout=60, json={
        "model": MODEL, "max_tokens": 2, "stop": [f"s{i}" for i in range(5000)], **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop" and f"at most {MAX_STOP_STRINGS} stop strings" in error["message"]


def test_the_native_endpoint_fails_only_the_request_with_too_many_stops(url: str) -> None:
    body = {"requests": [{"prompt": "hi", "sampling": {"max_tokens": 2, "stop": ["s"] * (MAX_STOP_STRINGS + 1)}},
                         {"prompt": "hi", "sampling": {"max_tokens": 2}}]}
    response = httpx.post(url + "/kev/v1/generate", json=body, timeout=60)
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    by_index = {event["index"]: event for event in events}
    assert by_index[0]["error"]["type"] == "InvalidRequestError"
    assert f"at most {MAX_STOP_STRINGS} stop strings" in by_index[0]["error"]["message"]
    assert by_index[1]["completion"]["completion_tokens"] == 2
