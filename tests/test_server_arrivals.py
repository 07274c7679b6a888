"""`kev serve` announces each request as it arrives (`Engine.arriving()`), so a burst of HTTP
requests shares the idle engine's first pass instead of starting it with the first.

No clock race: the engine's quiet window is a microsecond (nothing relies on it) and an
announcement's bound is raised to a minute. One request's headers arrive and its body is held
back: while it is on its way, eight openai-client requests queue and no pass starts; once its
body comes, all nine are one pass. The control, the same requests with announcements off, takes
two passes (the held request after the others)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
from conftest import tiny_model
from server_util import serving, wait_for

from kev_engine import Engine
from kev_engine.core import arrivals
from kev_engine.core.arrivals import Arrival
from kev_integrations.server import ServerConfig, build_app

KEY, MODEL, TIMEOUT = "k", "tiny", 60.0
HELD = json.dumps({"model": MODEL, "prompt": "The held request", "max_tokens": 2}).encode()


@pytest.fixture
def engine(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    monkeypatch.setattr(arrivals, "ANNOUNCED_MAX_S", TIMEOUT)  # only the announcements decide
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name=MODEL, coalesce_ms=0.001)
    engine.generate(["warm up"], {"max_tokens": 1})
    yield engine
    engine.close()


def held_request(url: str) -> socket.socket:
    """A /v1/completions request whose headers are sent and whose body is not (yet)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(HELD)}\r\n\r\n".encode())
    return sock


def finish(sock: socket.socket) -> str:
    """Send the held body; the response's status line."""
    sock.sendall(HELD)
    with sock, sock.makefile("rb") as response:
        return response.readline().decode().strip()


def burst(url: str) -> list[threading.Thread]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
    threads = [threading.Thread(target=client.completions.create,
                                kwargs={"model": MODEL, "prompt": f"Question {i}", "max_tokens": 2})
               for i in range(8)]
    for thread in threads:
        thread.start()
    return threads


def test_a_burst_waits_for_a_request_still_arriving(engine: Engine) -> None:
    with serving(build_app(engine, ServerConfig(api_keys=(KEY,)), model_name=MODEL)) as url:
        before = engine.stats()
        sock = held_request(url)
        wait_for(lambda: engine._worker.arrivals._announced, TIMEOUT, "the held request to be announced")
        threads = burst(url)
        wait_for(lambda: engine.stats()["waiting"] == 8, TIMEOUT, "the burst to queue")
        assert engine.stats()["prefill_passes"] == before["prefill_passes"]  # held: one is still on its way
        assert finish(sock).startswith("HTTP/1.1 200")
        for thread in threads:
            thread.join(TIMEOUT)
        after = engine.stats()
    assert after["requests"] - before["requests"] == 9 and after["prefill_passes"] - before["prefill_passes"] == 1


def test_the_control_without_announcements_the_held_request_comes_alone(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Engine, "arriving", lambda self: Arrival(-1, lambda token: None))
    with serving(build_app(engine, ServerConfig(api_keys=(KEY,)), model_name=MODEL)) as url:
        before = engine.stats()
        sock = held_request(url)
        for thread in burst(url):
            thread.join(TIMEOUT)  # answered while the held one is still on its way
        assert finish(sock).startswith("HTTP/1.1 200")
        after = engine.stats()
    assert after["requests"] - before["requests"] == 9 and after["prefill_passes"] - before["prefill_passes"] >= 2
