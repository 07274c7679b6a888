"""`kev serve` over HTTP on loopback: the real `openai` client, errors in OpenAI's shape, limits,
disconnects, metrics, health while loading. Every server is started by its test and stopped."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import make_adapter, tiny_model
from server_util import free_port, serving, wait_for

from kev_engine import Engine, SamplingParams
from kev_integrations.server import ServerConfig, build_app

KEY = "test-key"
MODEL = "tiny"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model = tiny_model("llama", tokenizer)
    folder = make_adapter(model, tmp_path_factory.mktemp("adapter") / "sql", seed=2)
    engine = Engine(model, tokenizer, name=MODEL)
    engine.load_adapter("sql", str(folder))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    config = ServerConfig(api_keys=(KEY,), admin_key="admin", max_queued=8, max_prompts=6, max_tokens_limit=64)
    with serving(build_app(engine, config, model_name=MODEL)) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_lists_the_base_model_and_each_adapter(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL, "sql"]


def test_chat_equals_the_engine_and_reports_usage(client: openai.OpenAI, engine: Engine) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    direct = engine.generate([CHAT], SamplingParams(max_tokens=8, temperature=0))[0]
    assert reply.choices[0].message.content == direct.text
    assert reply.choices[0].finish_reason == direct.finish_reason
    assert reply.usage.prompt_tokens == direct.prompt_tokens and reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == direct.prompt_tokens + 8


def test_a_list_of_prompts_is_one_pack_with_choices_by_index(client: openai.OpenAI, engine: Engine) -> None:
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Rain in Spain"]
    before = engine.stats()["prefill_passes"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert engine.stats()["prefill_passes"] == before + 1  # one request, one pack
    solo = [engine.generate([p], SamplingParams(max_tokens=6))[0].text for p in prompts]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == solo
    assert reply.usage.completion_tokens == 24


def test_streaming_equals_non_streaming_and_ends_with_usage(client: openai.OpenAI) -> None:
    settings: dict[str, Any] = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0.8, seed=5)
    whole = client.chat.completions.create(**settings)
    chunks = list(client.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_an_adapter_is_chosen_by_model_name_or_extra_body(client: openai.OpenAI, engine: Engine) -> None:
    direct = engine.generate([CHAT], SamplingParams(max_tokens=8), adapters="sql")[0].text
    base = engine.generate([CHAT], SamplingParams(max_tokens=8))[0].text
    assert direct != base  # the adapter really changes the answer
    by_model = client.chat.completions.create(model="sql", messages=CHAT, max_tokens=8)
    by_field = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, extra_body={"adapter": "sql"})
    assert by_model.choices[0].message.content == by_field.choices[0].message.content == direct


def test_a_json_schema_response_format_is_enforced(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    if reply.choices[0].finish_reason == "stop":  # a random-weight model may still run out of tokens
        assert set(json.loads(reply.choices[0].message.content)) == {"city"}
    else:
        assert reply.choices[0].message.content.startswith('{"city": "')


def test_wrong_or_missing_key_is_401_in_openai_shape(url: str) -> None:
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=url + "/v1", api_key=key or "x", max_retries=0,
                            default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        assert caught.value.body["code"] == "invalid_api_key"
    assert httpx.get(url + "/metrics").status_code == 401


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": CHAT, "temperature": -1}, "temperature", "temperature=-1"),
        ({"messages": CHAT, "best_of": 2}, "best_of", "best_of=2 is not supported"),
        ({"messages": CHAT, "n": 0}, "n", "n=0 is not allowed"),
        ({"messages": CHAT, "frobnicate": 1}, "frobnicate", "unsupported field"),
        ({"messages": CHAT, "max_tokens": 10_000}, "max_tokens", "over this server's limit"),
        ({"messages": [], "max_tokens": 4}, "messages", "non-empty list"),
        ({"messages": CHAT, "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "bogus"}}}}, None, 'Unsupported type "bogus"'),
        ({"messages": CHAT}, "max_tokens", "max_tokens=256 is over"),  # the default counts against the limit too
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": "abc"}], "max_tokens": 4},
         "messages[0].tool_calls", "messages[0].tool_calls must be a list"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}], "max_tokens": 4},
         "messages[0].tool_calls[0]", "messages[0].tool_calls[0] must be"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": [1]}}]}], "max_tokens": 4},
         "messages[0].tool_calls[0].function.arguments", "must be a JSON object, got list"),
        ({"messages": [{"role": "tool", "tool_call_id": [1], "content": "x"}], "max_tokens": 4},
         "messages[0].tool_call_id", "tool_call_id must be a string, got list"),
        # as OpenAI: a call without its id, a tool reply without the id it answers (both were accepted)
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}], "max_tokens": 4},
         "messages[1].tool_calls[0].id", "tool_calls[0].id is missing"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "sunny"}], "max_tokens": 4},
         "messages[1].tool_call_id", "tool_call_id is missing"),
        ({"messages": CHAT, "max_tokens": 4, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": "f"}}, "messages", "unexpected shape"),
    ],
)
def test_bad_values_are_400_naming_the_field(url: str, body: dict, param: str | None, words: str) -> None:
    response = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, **body},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_malformed_json_and_oversized_bodies(url: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    broken = httpx.post(url + "/v1/completions", content=b'{"model": "tiny", "prompt": ', headers=headers)
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    huge = httpx.post(url + "/v1/completions", content=b" " * (5 * 1024 * 1024), headers=headers, timeout=60)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "body_too_large"


def test_past_the_queue_limit_is_429_with_retry_after(url: str, engine: Engine) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    too_many = httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                          json={"model": MODEL, "prompt": ["a"] * 6, "max_tokens": 2})
    assert too_many.status_code == 200  # 6 fit under max_queued=8
    with engine.hold():  # nothing finishes while held: the first request keeps its 6 places
        first = threading.Thread(target=httpx.post, args=(url + "/v1/completions",), kwargs=dict(
            headers=headers, timeout=60, json={"model": MODEL, "prompt": ["b"] * 6, "max_tokens": 2}))
        first.start()
        wait_for(lambda: engine.stats()["waiting"] == 6, 30, "the first request to be queued")
        refused = httpx.post(url + "/v1/completions", headers=headers, timeout=60,
                             json={"model": MODEL, "prompt": ["c"] * 3, "max_tokens": 2})
    first.join(60)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"


def test_a_disconnected_stream_stops_its_computation(url: str, engine: Engine) -> None:
    before = engine.stats()
    with httpx.stream("POST", url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": MODEL, "messages": CHAT, "max_tokens": 64, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # the client is gone: the engine cancels the request and frees its KV, long before 64 tokens
    wait_for(lambda: engine.stats()["cancelled"] > before["cancelled"], 30, "the request to be cancelled")
    wait_for(lambda: engine.stats()["running"] == 0, 30, "the engine to be idle")
    assert engine.stats()["generated_tokens"] - before["generated_tokens"] < 64


def test_metrics_and_admin_endpoints(url: str, engine: Engine) -> None:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("kev_http_requests_total", "kev_forward_passes_total", "kev_queued_questions",
                 "kev_request_latency_seconds_bucket", "kev_kv_cache_bytes", "kev_prefix_hit_tokens_total"):
        assert name in text
    assert httpx.post(url + "/admin/defaults", json={"temperature": 0.5},
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 401  # the API key is not enough
    ok = httpx.post(url + "/admin/defaults", json={"temperature": 0.0}, headers={"Authorization": "Bearer admin"})
    assert ok.status_code == 200 and ok.json()["temperature"] == 0.0
    bad = httpx.post(url + "/admin/defaults", json={"temperature": -2}, headers={"Authorization": "Bearer admin"})
    assert bad.status_code == 400 and "temperature=-2" in bad.json()["error"]["message"]


def test_health_is_503_while_loading(tokenizer: Any) -> None:
    release = threading.Event()

    def slow_factory() -> Engine:
        assert release.wait(60)
        return Engine(tiny_model("qwen2", tokenizer), tokenizer, name="late")

    with serving(build_app(slow_factory, ServerConfig(), model_name="late")) as base:
        assert httpx.get(base + "/health").status_code == 503
        early = httpx.post(base + "/v1/completions", json={"model": "late", "prompt": "x"})
        assert early.status_code == 503 and "loading" in early.json()["error"]["message"]
        release.set()
        wait_for(lambda: httpx.get(base + "/health").status_code == 200, 60, "the model to load")
        assert httpx.post(base + "/v1/completions", json={"model": "late", "prompt": "x", "max_tokens": 2}).json()[
            "usage"]["completion_tokens"] == 2


def test_sigterm_lets_a_running_stream_finish_then_exits() -> None:
    """`kev serve` on the embedded model: SIGTERM mid-stream → the stream completes, new
    connections are refused, and the process exits 0."""
    import signal
    import subprocess
    import sys

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kev_integrations", "serve", "--port", str(port), "--grace", "60"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def healthy() -> bool:
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            try:
                return httpx.get(base + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, 180, "kev serve to load the embedded model")
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": CHAT, "max_tokens": 40, "stream": True,
                "stream_options": {"include_usage": True}}
        events: list[str] = []
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    process.send_signal(signal.SIGTERM)  # mid-stream
                events.append(line.removeprefix("data: "))
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]][-1]
        assert usage["completion_tokens"] == 40 or finish == "stop"  # answered in full, not cut off
        assert process.wait(timeout=90) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


def test_an_unknown_tool_choice_is_400_naming_the_tools(url: str) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    response = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                          json={"model": MODEL, "messages": CHAT, "tools": tools, "tool_choice": "multiply"})
    assert response.status_code == 400 and "['add']" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "tool_choice"


def test_deeply_nested_bodies_and_schemas_are_400(url: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    deep = httpx.post(url + "/v1/completions", content=b"[" * 50_000, headers=headers, timeout=60)
    assert deep.status_code == 400 and "nests JSON arrays or objects too deeply" in deep.json()["error"]["message"]
    assert "Recursion" not in deep.json()["error"]["message"]  # the client's terms, not Python's
    schema: dict = {"type": "string"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    nested = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "messages": CHAT, "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert nested.status_code == 400 and "nests deeper than 32" in nested.json()["error"]["message"]


def test_streamed_replies_with_tools_bound_keep_their_text(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    settings: dict[str, Any] = dict(model=MODEL, messages=CHAT, max_tokens=8, tools=tools, tool_choice="auto")
    whole = client.chat.completions.create(**settings).choices[0].message
    chunks = list(client.chat.completions.create(**settings, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (whole.content or "")
    streamed_calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert len(streamed_calls) == len(whole.tool_calls or [])


def test_empty_keys_are_refused_and_metrics_labels_are_route_templates(url: str) -> None:
    with pytest.raises(SystemExit, match="empty"):
        ServerConfig(api_keys=("",))
    with pytest.raises(SystemExit, match="empty"):
        ServerConfig(admin_key=" ")
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer"}).status_code == 401  # no token
    httpx.delete(url + '/admin/adapters/x%22%7D%20evil', headers={"Authorization": "Bearer wrong"})
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'endpoint="/admin/adapters/{name}",status="401"' in text and "evil" not in text
