"""What a probe of `kev serve` found (K1, K2 tenants, an admin key), each over loopback: adapter
names that could take the model's own name or never be unloaded, /metrics showing one tenant
the others' activity, an unbounded cache_salt, and Python's RecursionError text for a deeply
nested body. Each test failed on the server before these rules."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import make_adapter, tiny_model
from server_util import serving

from kev_engine import AdapterError, Engine, SamplingParams
from kev_integrations.server import ServerConfig, build_app

MODEL = "tiny-served"
K1, K2, ADMIN, OPS = "tenant-one", "tenant-two", "admin-key", "ops-key"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def setup(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, str]]:
    model = tiny_model("llama", tokenizer)
    folder = str(make_adapter(model, tmp_path_factory.mktemp("adapters") / "json", seed=3))
    engine = Engine(model, tokenizer, name="tiny-engine")
    yield engine, folder
    engine.close()


def test_an_adapter_can_neither_take_the_models_name_nor_a_name_no_url_can_unload(setup) -> None:
    engine, folder = setup
    config = ServerConfig(api_keys=(K1,), admin_key=ADMIN, max_tokens_limit=8)
    with serving(build_app(engine, config, model_name=MODEL)) as base:
        for name in (MODEL, "../x", "a/b", "", "x" * 65, "-lead", 7):
            answer = httpx.post(base + "/admin/adapters", headers=bearer(ADMIN), json={"name": name, "path": folder},
                                timeout=60)
            assert answer.status_code == 400, (name, answer.text)
            error = answer.json()["error"]
            assert error["param"] == "name" and ("not allowed" in error["message"] or "give {" in error["message"])
        assert engine.adapters == []
        models = httpx.get(base + "/v1/models", headers=bearer(K1), timeout=30).json()["data"]
        assert [m["id"] for m in models] == [MODEL]  # the model's name still answers as the model
        ok = httpx.post(base + "/admin/adapters", headers=bearer(ADMIN), json={"name": "json.v2_x-1", "path": folder},
                        timeout=60)
        assert ok.status_code == 200, ok.text
        gone = httpx.delete(base + "/admin/adapters/json.v2_x-1", headers=bearer(ADMIN), timeout=30)
        assert gone.status_code == 200 and engine.adapters == []  # a name that loads can be unloaded


def test_engine_load_adapter_applies_the_same_rule(setup) -> None:
    engine, folder = setup
    with pytest.raises(AdapterError, match=r"adapter name '\.\./x' is not allowed; use 1 to 64 letters"):
        engine.load_adapter("../x", folder)
    with pytest.raises(AdapterError, match="it is the served model's own name"):
        engine.load_adapter(engine.name, folder)
    assert engine.adapters == []


def metrics(base: str, key: str) -> httpx.Response:
    return httpx.get(base + "/metrics", headers=bearer(key), timeout=30)


def ask(base: str, key: str, content: str) -> None:
    answer = httpx.post(base + "/v1/chat/completions", headers=bearer(key), timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0})
    assert answer.status_code == 200, answer.text


def test_with_several_tenants_metrics_is_for_operators_and_a_tenant_sees_nothing_of_another(setup) -> None:
    engine, _ = setup
    config = ServerConfig(api_keys=(K1, K2), admin_key=ADMIN, metrics_key=OPS, max_tokens_limit=8)
    with serving(build_app(engine, config, model_name=MODEL)) as base:
        before = metrics(base, K2)
        for _ in range(2):  # only K1 sends: the same prompt twice (a prefix hit the second time)
            ask(base, K1, "The same long question about the same long document, " * 10)
        after = metrics(base, K2)
        assert (before.status_code, before.text) == (after.status_code, after.text)  # K2's view did not move
        assert after.status_code == 403 and after.json()["error"]["code"] == "metrics_for_operators"
        assert "--metrics-key" in after.json()["error"]["message"]
        for key in (OPS, ADMIN):
            seen = metrics(base, key)
            assert seen.status_code == 200 and "kev_prompt_tokens_total" in seen.text
        assert metrics(base, "wrong").status_code == 401
    single = ServerConfig(api_keys=(K1,), max_tokens_limit=8)  # one tenant: everything there is its own
    with serving(build_app(engine, single, model_name=MODEL)) as base:
        assert metrics(base, K1).status_code == 200


def test_a_cache_salt_is_bounded_and_a_deeply_nested_body_is_refused_in_plain_words(setup) -> None:
    engine, _ = setup
    with pytest.raises(ValueError, match="cache_salt is 257 characters; at most 256 are allowed"):
        SamplingParams(cache_salt="s" * 257)
    config = ServerConfig(api_keys=(K1, K2), max_tokens_limit=8, max_body_bytes=8 * 1024 * 1024)
    with serving(build_app(engine, config, model_name=MODEL)) as base:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "cache_salt": "s" * 1_000_000}
        answer = httpx.post(base + "/v1/chat/completions", headers=bearer(K1), json=body, timeout=60)
        assert answer.status_code == 400 and "cache_salt is 1000000 characters" in answer.text
        body["cache_salt"] = "s" * 256  # the most a client may send, inside its tenant's namespace
        assert httpx.post(base + "/v1/chat/completions", headers=bearer(K1), json=body, timeout=60).status_code == 200
        nested = b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        answer = httpx.post(base + "/v1/chat/completions", headers={**bearer(K1), "Content-Type": "application/json"},
                            content=nested, timeout=60)
        assert answer.status_code == 400
        message = answer.json()["error"]["message"]
        assert "nests JSON arrays or objects too deeply" in message
        assert "Recursion" not in message and "recursion" not in message


def tool(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 4,
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}}, "required": ["city"]}}}


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("endpoint", "body", "param", "words"), [
    ("chat", {"messages": HI, "logit_bias": {"999999": 5}}, "logit_bias", "outside this model's vocabulary"),
    ("chat", {"messages": HI, "stop_token_ids": [10**9]}, "stop_token_ids", "outside this model's vocabulary"),
    ("chat", {"messages": [{"role": "user", "content": "word " * 40_000}]}, "messages", "context"),
    ("completions", {"prompt": "word " * 40_000}, "prompt", "context"),
    ("chat", {"messages": [{"role": "user", "content": None}]}, "messages", "empty"),
    ("chat", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "d" * 200_000}}}}, "response_format", "characters"),
    ("chat", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, "response_format", "could not be compiled"),
    ("completions", {"prompt": "hi", "response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format",
     "could not be compiled"),
    ("chat", {"messages": HI, "response_format": {"type": "grammar", "grammar": "root ::= nothing_defined"}},
     "response_format", "could not be compiled"),
    ("chat", {"messages": HI, "tools": [tool(i) for i in range(2_000)], "tool_choice": "required"}, "tools",
     "the tool-call constraint these tools make"),
])
def test_every_refusal_names_the_field_the_client_sent(setup, endpoint, body, param, words) -> None:
    engine, _ = setup
    config = ServerConfig(api_keys=(K1,), max_tokens_limit=8, max_body_bytes=8 * 1024 * 1024)
    with serving(build_app(engine, config, model_name=MODEL)) as base:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        answer = httpx.post(base + path, headers=bearer(K1), json={"model": MODEL, "max_tokens": 2, **body},
                            timeout=120)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "structural_tag" not in error["message"] or param != "tools"
