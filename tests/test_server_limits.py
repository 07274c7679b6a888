"""What one caller may hold on a real `kev serve`: tokenize work, connections, slow headers and bodies.

Slow work is made by holding the tokenizer at a gate the test opens; slow clients are raw
sockets that never finish what they started. Each refusal checked is the only answer possible
while the test holds things back: nothing races a clock.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import tiny_model
from server_util import serving, wait_for

from kev_engine import Engine
from kev_integrations.server import ServerConfig, build_app
from kev_integrations.server.header_deadline import header_deadline_protocol

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


def connect(base: str) -> socket.socket:
    parts = urlsplit(base)
    return socket.create_connection((parts.hostname, parts.port), timeout=30)


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the next response on `sock` (bounded by its 30 s timeout)."""
    def more() -> bytes:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection without a response"
        return chunk

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").lower().split("\r\n")
    length = int(next(line.split(":")[1] for line in lines if line.startswith("content-length")))
    while len(body) < length:
        body += more()
    return int(lines[0].split()[1]), json.loads(body)


def read_all(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """The one response the server sends before it closes the connection, which must follow."""
    response = read_response(sock)
    assert sock.recv(65536) == b"", "the server kept the connection open"
    return response


def request_head(path: str, key: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def test_a_body_that_dribbles_in_gets_a_408_and_its_connection_closed(engine: Engine) -> None:
    config = ServerConfig(api_keys=(KEY_A,), body_timeout_s=0.5)
    with serving(build_app(engine, config, model_name=MODEL)) as base, connect(base) as sock:
        sock.sendall(request_head("/v1/chat/completions", KEY_A, 200))
        sock.sendall(b'{"model"')  # ... and the rest never comes
        status, body = read_all(sock)
    assert status == 408 and body["error"]["code"] == "body_timeout" and "0.5 s" in body["error"]["message"]


def test_headers_that_dribble_in_get_a_408_and_a_request_being_answered_is_not_cut(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", held)
    app = build_app(engine, ServerConfig(api_keys=(KEY_A,)), model_name=MODEL)
    with serving(app, http=header_deadline_protocol(0.5)) as base, ThreadPoolExecutor(1) as pool:
        # opened first: a request whose answer takes longer than the header deadline
        answering = pool.submit(httpx.post, base + "/kev/v1/tokenize", json={"text": "Hello"}, headers=auth(KEY_A),
                                timeout=60)
        wait_for(lambda: held.calls == 1, 30, "the slow request to be answering")
        with connect(base) as sock:  # then a slow-loris: a header line begun, never ended
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: te")
            status, body = read_all(sock)
        assert status == 408 and body["error"]["code"] == "header_timeout"
        # the first connection's deadline fell before the second's: it did not cut the answer
        held.release()
        reply = answering.result(timeout=60)
        assert reply.status_code == 200 and reply.json()["ids"]
        with connect(base) as sock:  # after a response, the next request's headers have the same deadline
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            assert read_response(sock)[0] == 200
            sock.sendall(b"GET /hea")
            assert read_all(sock)[0] == 408


def test_connections_past_the_cap_get_a_503_and_one_closing_frees_a_place(engine: Engine) -> None:
    """Keys and the queue bound requests; idle keep-alive sockets are bounded by the connection cap."""
    app = build_app(engine, ServerConfig(api_keys=(KEY_A,)), model_name=MODEL)
    with serving(app, http=header_deadline_protocol(30, max_connections=2, retry_after_s=3)) as base:
        first, second = connect(base), connect(base)
        try:
            for sock in (first, second):  # both served, both kept open (keep-alive)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
                assert read_response(sock)[0] == 200
            with connect(base) as third:
                status, body = read_all(third)
            assert status == 503 and body["error"]["code"] == "too_many_connections"
            assert "2 connections open" in body["error"]["message"]
        finally:
            first.close()
        wait_for(lambda: httpx.get(base + "/health", timeout=30).status_code == 200, 30, "a place to be free again")
        second.close()


def test_one_key_cannot_hold_more_than_its_share_of_requests(engine: Engine) -> None:
    config = ServerConfig(api_keys=(KEY_A, KEY_B), max_requests_per_key=2, body_timeout_s=60)
    app = build_app(engine, config, model_name=MODEL)
    state = app.state.kev
    tenant_a = state.tenants.of(KEY_A).id
    with serving(app) as base:
        held = [connect(base) for _ in range(2)]
        try:
            for sock in held:  # two requests of A in flight: their bodies have begun, not ended
                sock.sendall(request_head("/v1/chat/completions", KEY_A, 100) + b"{")
            wait_for(lambda: state.in_flight[tenant_a] == 2, 30, "A's two requests to be in flight")
            refused = httpx.get(base + "/v1/models", headers=auth(KEY_A), timeout=30)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_requests_per_key"
            assert "limit is 2 per key" in refused.json()["error"]["message"]
            assert httpx.get(base + "/v1/models", headers=auth(KEY_B), timeout=30).status_code == 200
            assert httpx.get(base + "/health", timeout=30).status_code == 200
        finally:
            for sock in held:
                sock.close()
        wait_for(lambda: state.in_flight[tenant_a] == 0, 30, "A's abandoned requests to end")
        assert httpx.get(base + "/v1/models", headers=auth(KEY_A), timeout=30).status_code == 200
