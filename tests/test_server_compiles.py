"""Grammar compiles on a real `kev serve`: a pool of their own, a time budget, a per-key limit.

A slow compile is made by holding xgrammar's compiler at a gate the test opens (the package's
own code runs unchanged), so nothing here races a clock: each refusal checked below is the only
answer possible while the gate is shut.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import xgrammar
from conftest import tiny_model
from server_util import serving, wait_for

from kev_engine import Engine
from kev_integrations.server import ServerConfig, build_app

KEY_A, KEY_B, OPS = "compile-a", "compile-b", "operator"
MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name=MODEL)
    yield engine
    engine.close()


class Gate:
    """xgrammar's JSON-schema compile, held until `open()`: a compile as slow as the test wants."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0
        real = xgrammar.GrammarCompiler.compile_json_schema

        def held(compiler: Any, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.entered += 1
            assert self._open.wait(60), "the test never opened the gate"
            return real(compiler, *args, **kwargs)

        monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_json_schema", held)

    def open(self) -> None:
        self._open.set()


def schema(i: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"field_{i}": {"type": "boolean"}}, "required": [f"field_{i}"]}


def ask(base: str, key: str, response_schema: dict[str, Any] | None) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Give a number as JSON."}],
                            "max_tokens": 12, "temperature": 0}
    if response_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "n", "schema": response_schema}}
    return httpx.post(base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)


def refusal(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_a_slow_compile_holds_only_its_own_key_and_gets_its_answer_at_the_budget(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    config = ServerConfig(api_keys=(KEY_A, KEY_B), metrics_key=OPS, max_tokens_limit=16, compile_workers=1,
                          max_compiles_per_key=1, compile_timeout_s=0.3)
    app = build_app(engine, config, model_name=MODEL)
    compiles = app.state.kev.compiles
    gate = Gate(monkeypatch)
    with serving(app) as base, ThreadPoolExecutor(1) as pool:
        slow = pool.submit(ask, base, KEY_A, schema(1))
        wait_for(lambda: gate.entered == 1, 30, "A's compile to start")
        assert ask(base, KEY_B, None).status_code == 200  # a plain request is not held behind it
        error = refusal(ask(base, KEY_A, schema(2)), 429)  # A's one compile slot is taken
        assert error["code"] == "compiles_per_key" and "limit 1 per key" in error["message"]
        error = refusal(ask(base, KEY_B, schema(3)), 429)  # B is not limited by A's key, but no thread is free
        assert error["code"] == "compiles_busy" and "within 0.3 s" in error["message"]
        error = refusal(slow.result(timeout=60), 400)  # A gets its answer at its budget, compile or not
        assert "did not compile within 0.3 s" in error["message"]
        assert compiles.in_flight() == (1, 0)  # ... while its compile runs on, nobody waiting for it
        assert refusal(ask(base, KEY_A, schema(2)), 429)["code"] == "compiles_per_key"  # and holds A's slot
        metrics = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {OPS}"}, timeout=30).text
        assert "\nkev_grammar_compiles_in_flight 1.0\n" in metrics and "\nkev_grammar_cache_bytes " in metrics
        gate.open()
        wait_for(lambda: compiles.in_flight() == (0, 0), 30, "A's compile to finish")
        done = engine.stats()["grammar_compiles"]
        again = ask(base, KEY_A, schema(1))  # the compile A gave up on was cached: the same request now runs
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"]["content"].startswith('{"field_1": ')  # schema 1's grammar
        assert engine.stats()["grammar_compiles"] == done


def test_requests_for_one_schema_share_one_compile(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    config = ServerConfig(api_keys=(KEY_A,), max_tokens_limit=16, compile_workers=1, max_compiles_per_key=1,
                          compile_timeout_s=60)
    app = build_app(engine, config, model_name=MODEL)
    gate = Gate(monkeypatch)
    before = engine.stats()["grammar_compiles"]
    with serving(app) as base, ThreadPoolExecutor(3) as pool:
        replies = [pool.submit(ask, base, KEY_A, schema(10)) for _ in range(3)]
        wait_for(lambda: app.state.kev.compiles.in_flight() == (1, 3), 30, "three requests to wait on one compile")
        gate.open()
        assert [r.result(timeout=60).status_code for r in replies] == [200, 200, 200]  # no per-key 429
    assert gate.entered == 1 and engine.stats()["grammar_compiles"] == before + 1


def test_a_bad_schema_is_400_from_the_compile_pool_and_fails_alone_natively(engine: Engine) -> None:
    config = ServerConfig(api_keys=(KEY_A,), max_tokens_limit=16)
    with serving(build_app(engine, config, model_name=MODEL)) as base:
        error = refusal(ask(base, KEY_A, {"type": "bogus"}), 400)
        assert 'Unsupported type "bogus"' in error["message"]
        body = {"requests": [{"prompt": "x", "sampling": {"json_schema": {"type": "bogus"}, "max_tokens": 2}},
                             {"prompt": "y", "sampling": {"max_tokens": 2}}]}
        with httpx.stream("POST", base + "/kev/v1/generate", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY_A}"}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        outcomes = {e["index"]: e for e in events if "text" not in e}
        assert outcomes[0]["error"]["type"] == "ConstraintError" and "completion" in outcomes[1]
