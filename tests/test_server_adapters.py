"""An adapter unloaded while its requests finish has a visible state (issue 23, item 7): `draining`
in GET /admin/adapters, a repeated DELETE that says so, and a reload that waits for it (bounded)
or answers 409 saying why. Over loopback; the engine is held, so "still in use" is certain."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import make_adapter, tiny_model
from server_util import serving

from kev_engine import Engine, SamplingParams
from kev_integrations.server import ServerConfig, build_app

MODEL = "tiny"
ADMIN = {"Authorization": "Bearer admin"}


@pytest.fixture
def setup(tokenizer: Any, tmp_path: Path) -> Iterator[tuple[Engine, str]]:
    model = tiny_model("llama", tokenizer)
    folder = str(make_adapter(model, tmp_path / "sql", seed=2))
    engine = Engine(model, tokenizer, name=MODEL)
    engine.load_adapter("sql", folder)
    yield engine, folder
    engine.close()


def _app(engine: Engine, wait_s: float) -> Any:
    return build_app(engine, ServerConfig(admin_key="admin", adapter_drain_wait_s=wait_s), model_name=MODEL)


def test_a_draining_adapter_is_listed_and_a_second_delete_says_so(setup: tuple[Engine, str]) -> None:
    engine, _ = setup
    with serving(_app(engine, 0)) as url:
        assert httpx.get(url + "/admin/adapters", headers=ADMIN).json() == {
            "adapters": [{"name": "sql", "state": "loaded"}]}
        with engine.hold():  # the request cannot finish: the adapter stays in use
            running = engine.submit("SELECT", SamplingParams(max_tokens=2), adapter="sql")
            first = httpx.delete(url + "/admin/adapters/sql", headers=ADMIN)
            listed = httpx.get(url + "/admin/adapters", headers=ADMIN).json()
            again = httpx.delete(url + "/admin/adapters/sql", headers=ADMIN)
        assert first.status_code == 202 and first.json()["state"] == "draining" and first.json()["requests"] == 1
        assert listed == {"adapters": [{"name": "sql", "state": "draining", "requests": 1}]}
        assert again.status_code == 202, again.text  # not 404 "unknown adapter"
        assert "'sql' is draining: 1 request(s)" in again.json()["message"]
        assert running.result(60).completion_tokens == 2  # its request finished: the adapter is gone
        assert httpx.get(url + "/admin/adapters", headers=ADMIN).json() == {"adapters": []}
        gone = httpx.delete(url + "/admin/adapters/sql", headers=ADMIN)
        assert gone.status_code == 404 and "unknown adapter 'sql'" in gone.json()["error"]["message"]


def test_an_idle_adapter_is_unloaded_at_once(setup: tuple[Engine, str]) -> None:
    engine, _ = setup
    with serving(_app(engine, 0)) as url:
        response = httpx.delete(url + "/admin/adapters/sql", headers=ADMIN)
    assert response.status_code == 200 and response.json() == {"name": "sql", "state": "unloaded", "adapters": []}


def test_loading_a_draining_name_waits_for_its_requests(setup: tuple[Engine, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    engine, folder = setup
    waiting = threading.Event()
    wait_for_unload = engine.wait_for_unload

    def spy(name: str, timeout: float) -> bool:
        waiting.set()  # the load has reached the wait: only now may the drain end
        return wait_for_unload(name, timeout)

    monkeypatch.setattr(engine, "wait_for_unload", spy)
    replies: list[httpx.Response] = []
    with serving(_app(engine, 60)) as url:
        with engine.hold():
            running = engine.submit("SELECT", SamplingParams(max_tokens=2), adapter="sql")
            assert httpx.delete(url + "/admin/adapters/sql", headers=ADMIN).status_code == 202
            load = threading.Thread(target=lambda: replies.append(httpx.post(
                url + "/admin/adapters", headers=ADMIN, json={"name": "sql", "path": folder}, timeout=90)))
            load.start()
            assert waiting.wait(60), "the load never waited for the drain"
        load.join(90)
        assert running.result(60).completion_tokens == 2
        assert replies[0].status_code == 200, replies[0].text
        assert httpx.get(url + "/admin/adapters", headers=ADMIN).json() == {
            "adapters": [{"name": "sql", "state": "loaded"}]}


def test_loading_a_name_still_draining_after_the_wait_is_409(setup: tuple[Engine, str]) -> None:
    engine, folder = setup
    with serving(_app(engine, 0)) as url:
        with engine.hold():
            running = engine.submit("SELECT", SamplingParams(max_tokens=2), adapter="sql")
            httpx.delete(url + "/admin/adapters/sql", headers=ADMIN)
            refused = httpx.post(url + "/admin/adapters", headers=ADMIN, json={"name": "sql", "path": folder})
        running.result(60)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "adapter_draining" and error["param"] == "name"
    assert "'sql' is still draining: 1 request(s)" in error["message"]
