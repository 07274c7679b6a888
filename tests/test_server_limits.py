"""What one caller may hold on a real `kev serve`: tokenize work.

Slow work is made by holding the tokenizer at a gate the test opens. Each refusal checked is
the only answer possible while the test holds things back: nothing races a clock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from conftest import tiny_model
from server_util import serving, wait_for

from kev_engine import Engine
from kev_integrations.server import ServerConfig, build_app

KEY_A, KEY_B = "limits-a", "limits-b"
MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name=MODEL)
    yield engine
    engine.close()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class HeldTokenizer:
    """The engine's tokenizer, its calls held until `release()`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer, self._released, self._lock = tokenizer, threading.Event(), threading.Lock()
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls += 1
        assert self._released.wait(60), "the test never released the tokenizer"
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def release(self) -> None:
        self._released.set()


def test_tokenize_runs_off_the_event_loop_bounded_in_size_and_number(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    config = ServerConfig(api_keys=(KEY_A,), tokenize_workers=2, max_pending_tokenize=3, max_tokenize_bytes=1000)
    app = build_app(engine, config, model_name=MODEL)
    held = HeldTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", held)
    text = "The capital of France is Paris."
    with serving(app) as base, ThreadPoolExecutor(3) as pool:
        def tokenize(body: Any) -> httpx.Response:
            return httpx.post(base + "/kev/v1/tokenize", json=body, headers=auth(KEY_A), timeout=60)

        running = [pool.submit(tokenize, {"text": text}) for _ in range(3)]
        wait_for(lambda: held.calls == 2 and app.state.kev.tokenize.pending == 3, 30, "two running, one waiting")
        # the event loop is free while the tokenizer works: /health and other requests answer
        assert httpx.get(base + "/health", timeout=30).status_code == 200
        assert httpx.get(base + "/v1/models", headers=auth(KEY_A), timeout=30).status_code == 200
        busy = tokenize({"text": text})
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "tokenize_busy"
        assert "limit is 3" in busy.json()["error"]["message"]
        held.release()
        expected = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert [r.result(timeout=60).json()["ids"] for r in running] == [expected] * 3
        too_large = tokenize({"text": "x" * 2000})
        assert too_large.status_code == 413 and "at most 1000 bytes" in too_large.json()["error"]["message"]
        chunked = httpx.post(base + "/kev/v1/tokenize", headers=auth(KEY_A), timeout=60,
                             content=iter([b'{"text": "', b"y" * 2000, b'"}']))  # no Content-Length
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "body_too_large"

