"""Every way a request can end has a well-formed answer (issue 23, item 4), on uvicorn over loopback.

When `--grace` runs out, uvicorn cancels what still runs: a plain request must get a JSON 503 in
OpenAI's shape with Retry-After (not uvicorn's plain-text 500), a stream an SSE error event and
then ``[DONE]``. The engine is held throughout, so no request can finish before the grace ends:
the outcome never depends on how long anything takes.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from conftest import tiny_model
from server_util import serving, wait_for

from kev_engine import Engine
from kev_integrations.server import ServerConfig, build_app
from kev_integrations.server import app as server_app
from kev_integrations.server.drain import DrainingServer
from kev_integrations.server.responses import ChunkWriter

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 8}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name=MODEL)
    yield engine
    engine.close()


def _events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def _in_thread(work: Callable[[], Any], results: dict[str, Any], name: str) -> threading.Thread:
    def run() -> None:
        try:
            results[name] = work()
        except BaseException as exc:  # noqa: BLE001 - the test reads what the client raised
            results[name] = exc

    thread = threading.Thread(target=run, name=f"client-{name}", daemon=True)
    thread.start()
    return thread


def test_requests_cut_when_the_grace_runs_out_get_well_formed_errors(engine: Engine) -> None:
    results: dict[str, Any] = {}
    headers_in = {name: threading.Event() for name in ("stream", "native", "openai")}

    def streamed(url: str, path: str, body: dict[str, Any], name: str) -> Callable[[], list[str]]:
        def read() -> list[str]:
            with httpx.stream("POST", url + path, json=body, timeout=60) as response:
                headers_in[name].set()  # the response has started: the cut lands mid-stream
                return _events(response)
        return read

    def openai_stream(url: str) -> Callable[[], Any]:
        def read() -> Any:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            chunks = client.chat.completions.create(**CHAT, stream=True)
            headers_in["openai"].set()
            return list(chunks)
        return read

    with engine.hold():  # nothing runs: every request is still unfinished when the grace ends
        with serving(build_app(engine, ServerConfig(), model_name=MODEL), grace=0.2) as url:
            native = {"requests": [{"prompt": "Hi", "stream": True}]}
            work = {"plain": lambda: httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60),
                    "stream": streamed(url, "/v1/chat/completions", {**CHAT, "stream": True}, "stream"),
                    "native": streamed(url, "/kev/v1/generate", native, "native"),
                    "openai": openai_stream(url)}
            threads = [_in_thread(read, results, name) for name, read in work.items()]
            wait_for(lambda: engine.stats()["waiting"] == 4, 30, "all four requests to be queued")
            for name, started in headers_in.items():
                assert started.wait(30), f"the {name} response never started"
        # leaving `serving` stops uvicorn: after the 0.2 s grace it cancels all four
        for thread in threads:
            thread.join(60)

    plain = results["plain"]
    assert isinstance(plain, httpx.Response), plain
    assert plain.status_code == 503 and plain.headers["retry-after"] == "5"
    assert plain.headers["content-type"] == "application/json"
    error = plain.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == "shutting_down" and "--grace" in error["message"]
    for name in ("stream", "native"):
        events = results[name]
        assert events[-1] == "[DONE]", (name, events)
        assert json.loads(events[-2])["error"]["code"] == "shutting_down", (name, events)
    assert isinstance(results["openai"], openai.APIError)  # the client raises: it never mistakes a cut for an end
    assert "shutting down" in str(results["openai"])


def test_an_unexpected_error_is_a_json_500_or_an_error_event_then_done(engine: Engine,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the server")

    monkeypatch.setattr(server_app, "chat_response", broken)  # fails after the engine answered
    monkeypatch.setattr(ChunkWriter, "finish", broken)  # fails once a stream has started
    with serving(build_app(engine, ServerConfig(), model_name=MODEL)) as url:
        plain = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
        with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60) as response:
            events = _events(response)
    assert plain.status_code == 500 and plain.headers["content-type"] == "application/json"
    error = plain.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "server_error"
    assert "RuntimeError: a bug in the server" in error["message"]
    assert json.loads(events[0])["choices"][0]["delta"]["content"]  # text streamed first...
    assert "RuntimeError: a bug in the server" in json.loads(events[-2])["error"]["message"]  # ...then the error
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize("path, body, error_of", [
    ("/v1/chat/completions", {**CHAT, "stream": True}, lambda event: event["error"]["type"] == "timeout_error"),
    ("/kev/v1/generate", {"requests": [{"prompt": "Hi", "stream": True}]},
     lambda event: event["error"]["type"] == "TimeoutError"),
])
def test_a_stream_past_the_request_timeout_ends_with_an_error_then_done(
        engine: Engine, path: str, body: dict[str, Any], error_of: Callable[[dict[str, Any]], bool]) -> None:
    with serving(build_app(engine, ServerConfig(request_timeout_s=0.2), model_name=MODEL)) as url:
        with engine.hold():  # the request cannot finish: its deadline passes first
            with httpx.stream("POST", url + path, json=body, timeout=60) as response:
                events = _events(response)
    assert events[-1] == "[DONE]" and error_of(json.loads(events[-2])), events


def test_an_unknown_path_or_method_is_an_error_in_openai_shape(engine: Engine) -> None:
    with serving(build_app(engine, ServerConfig(), model_name=MODEL)) as url:
        unknown = httpx.post(url + "/v1/embeddings", json={"model": MODEL, "input": "hi"})
        wrong_method = httpx.post(url + "/v1/models")
    assert unknown.status_code == 404 and set(unknown.json()["error"]) == ERROR_KEYS
    assert "no such endpoint: POST /v1/embeddings" in unknown.json()["error"]["message"]
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "GET"
    assert "method not allowed: POST /v1/models" in wrong_method.json()["error"]["message"]


def test_during_the_grace_new_requests_get_503_on_an_open_socket_while_running_ones_finish(engine: Engine) -> None:
    """A SIGTERM (handle_exit) keeps the socket open: a new request is answered 503 shutting_down with
    Retry-After (not refused at the socket), /health says shutting_down, the request in flight is
    answered in full, and the server then stops by itself. `hold()` keeps that request queued until
    the test lets it run: nothing here races a clock."""
    app = build_app(engine, ServerConfig(), model_name=MODEL)
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=60), app.state.kev, grace=60)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    results: dict[str, Any] = {}
    try:
        wait_for(lambda: server.started, 30, "uvicorn to start")
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        with engine.hold():
            ask = lambda: httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)  # noqa: E731
            first = _in_thread(ask, results, "first")
            wait_for(lambda: engine.stats()["waiting"] == 1, 30, "the first request to be queued")
            server.handle_exit(signal.SIGTERM, None)
            late = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
            assert late.status_code == 503 and late.headers["retry-after"] == "5"
            assert late.json()["error"]["code"] == "shutting_down" and "takes no new requests" in late.text
            health = httpx.get(url + "/health", timeout=30)
            assert (health.status_code, health.json()) == (503, {"status": "shutting_down"})
        first.join(60)
        assert results["first"].status_code == 200 and results["first"].json()["choices"][0]["message"]["content"]
        thread.join(30)
        assert not thread.is_alive()  # nothing left in flight: it stopped without waiting out the grace
    finally:
        server.should_exit = True
        thread.join(30)
