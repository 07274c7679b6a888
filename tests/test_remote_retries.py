"""`max_retries` with `base_url` (issue 23, item 10): connection errors, 429 and 503 are retried
with backoff, as the server's Retry-After asks; other 4xx never; a stream never once it started;
without `base_url`, `max_retries` is refused saying why.

Against real `kev serve` apps on loopback. `Refusing` stands in front of one to script refusals
and count the requests that reach it; where a wait would be long (the server's own "still
loading" asks for 5 s) the wait is replaced by an event, so no test depends on a clock.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import pytest
from conftest import QUESTIONS, tiny_model
from server_util import free_port, serving, wait_for

import kev_integrations.remote as remote_module
from kev_engine import Engine, KevError, SamplingParams
from kev_integrations.remote import RemoteEngine
from kev_integrations.retry import BASE_DELAY_S, MAX_DELAY_S, retry_after, retry_delay
from kev_integrations.server import ServerConfig, build_app
from kev_integrations.shared import clear_shared_engines

KEY = "retry-key"
TIMEOUT = 60  # seconds; a wait that runs out means a hang
GREEDY = SamplingParams(temperature=0, max_tokens=4)
GENERATE = "/kev/v1/generate"


class Refusing:
    """An ASGI app in front of Kev's: the first requests to `path` get `refusals` (status, headers)
    or, for status 200, a stream cut after one event; later ones pass. `seen` counts every request
    to `path`."""

    def __init__(self, app: Any, path: str, refusals: list[tuple[int, dict[str, str]]]) -> None:
        self.app, self.path, self.refusals, self.seen = app, path, list(refusals), 0

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["path"] != self.path:
            return await self.app(scope, receive, send)
        self.seen += 1
        if not self.refusals:
            return await self.app(scope, receive, send)
        status, headers = self.refusals.pop(0)
        raw_headers = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in headers.items())]
        await send({"type": "http.response.start", "status": status, "headers": raw_headers})
        if status == 200:  # an answer that starts, then the connection drops (no end of the body)
            await send({"type": "http.response.body", "body": b'data: {"index": 0, "text": "Hel"}\n\n',
                        "more_body": True})
            raise ConnectionResetError("scripted: the server went away mid-answer")
        error = {"error": {"message": f"scripted {status}", "type": "server_error", "param": None, "code": None}}
        await send({"type": "http.response.body", "body": json.dumps(error).encode()})


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("qwen2", tokenizer), tokenizer, name="tiny", coalesce_ms=0)
    yield engine
    engine.close()


@pytest.fixture
def refusing(engine: Engine) -> Iterator[Callable[..., tuple[str, Refusing]]]:
    """`refusing(refusals, path=GENERATE)` → (base URL, the front app) of a fresh server."""
    stack: list[Any] = []

    def start(refusals: list[tuple[int, dict[str, str]]], path: str = GENERATE) -> tuple[str, Refusing]:
        front = Refusing(build_app(engine, ServerConfig(api_keys=(KEY,)), model_name="tiny"), path, refusals)
        context = serving(front)
        stack.append(context)
        return context.__enter__(), front

    yield start
    clear_shared_engines()  # the front ends' shared RemoteEngines for these servers
    for context in reversed(stack):
        context.__exit__(None, None, None)


@pytest.fixture
def delays(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits the client chose (the real rule), recorded; each is then waited as 0 s."""
    chosen: list[float] = []

    def record(attempt: int, headers: Any = None) -> float:
        chosen.append(retry_delay(attempt, headers, jitter=lambda: 0.0))
        return 0.0

    monkeypatch.setattr(remote_module, "retry_delay", record)
    return chosen


def test_429_and_503_are_retried_as_retry_after_asks(refusing: Any, delays: list[float], engine: Engine) -> None:
    url, front = refusing([(503, {"Retry-After": "2"}), (429, {"retry-after-ms": "250"}), (503, {})])
    client = RemoteEngine(url, api_key=KEY, max_retries=3, timeout=TIMEOUT)
    try:
        replies = client.generate(QUESTIONS[:2], GREEDY)
    finally:
        client.close()
    assert front.seen == 4 and delays == [2.0, 0.25, BASE_DELAY_S * 4]  # as asked; no header: backoff
    assert [r.token_ids for r in replies] == [r.token_ids for r in engine.generate(QUESTIONS[:2], GREEDY)]


def test_retries_run_out_naming_how_many_and_none_by_default(refusing: Any, delays: list[float]) -> None:
    url, front = refusing([(503, {"Retry-After": "0"})] * 5)
    client = RemoteEngine(url, api_key=KEY, max_retries=2, timeout=TIMEOUT)
    with pytest.raises(KevError, match=r"503: scripted 503 \(after 2 retries\)"):
        client.generate(QUESTIONS[:1], GREEDY)
    assert front.seen == 3
    client.close()
    once = RemoteEngine(url, api_key=KEY, timeout=TIMEOUT)  # max_retries=0: the first refusal is the answer
    with pytest.raises(KevError, match=r"503: scripted 503$"):
        once.generate(QUESTIONS[:1], GREEDY)
    assert front.seen == 4
    once.close()


@pytest.mark.parametrize("status", [400, 401, 404, 413, 422])
def test_other_4xx_are_never_retried(refusing: Any, delays: list[float], status: int) -> None:
    url, front = refusing([(status, {"Retry-After": "0"})])
    client = RemoteEngine(url, api_key=KEY, max_retries=5, timeout=TIMEOUT)
    try:
        with pytest.raises(KevError, match="scripted"):
            client.generate(QUESTIONS[:1], GREEDY)
    finally:
        client.close()
    assert front.seen == 1 and delays == []


def test_a_stream_is_never_retried_once_it_started(refusing: Any, delays: list[float]) -> None:
    url, front = refusing([(200, {})])
    client = RemoteEngine(url, api_key=KEY, max_retries=5, timeout=TIMEOUT)
    pieces: list[str] = []
    try:
        future = client.submit(QUESTIONS[0], GREEDY, on_text=pieces.append)
        assert isinstance(future.exception(timeout=TIMEOUT), KevError)
    finally:
        client.close()
    assert pieces == ["Hel"] and front.seen == 1 and delays == []  # its text reached on_text: not sent again


def test_a_connection_error_is_retried_until_the_server_is_up(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    refused, up = threading.Event(), threading.Event()

    def wait_for_the_server(attempt: int, headers: Any = None) -> float:
        refused.set()  # the first connection was refused: nothing listens yet
        assert up.wait(TIMEOUT)
        return 0.0

    monkeypatch.setattr(remote_module, "retry_delay", wait_for_the_server)
    connecting: Future[RemoteEngine] = Future()
    threading.Thread(target=lambda: connecting.set_result(
        RemoteEngine(f"http://127.0.0.1:{port}", api_key=KEY, max_retries=1, timeout=TIMEOUT)), daemon=True).start()
    assert refused.wait(TIMEOUT)
    with serving(build_app(engine, ServerConfig(api_keys=(KEY,)), model_name="tiny"), port=port):
        up.set()
        client = connecting.result(timeout=TIMEOUT)
        try:
            assert client.generate(QUESTIONS[:1], GREEDY)[0].completion_tokens == 4
        finally:
            client.close()
    with pytest.raises(KevError, match=r"ConnectError.*\(after 1 retries\)"):  # nothing listens any more
        RemoteEngine(f"http://127.0.0.1:{port}", api_key=KEY, max_retries=1, timeout=TIMEOUT)


@pytest.mark.parametrize("front_end", ["ChatKev", "KevLLM", "Kev"])
def test_every_front_end_waits_for_a_server_still_loading(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, front_end: str
) -> None:
    """The server's own 503 "still loading" (Retry-After: 5) while its model loads."""
    from kev_integrations.langchain import ChatKev, KevLLM
    from kev_integrations.llamaindex import Kev

    loaded = threading.Event()
    asked: list[float] = []
    urls: list[str] = []

    def load() -> Engine:  # the server closes what its factory built: a fresh tiny engine
        assert loaded.wait(TIMEOUT)
        return Engine(tiny_model("qwen2", tokenizer), tokenizer, name="tiny", coalesce_ms=0)

    def let_it_load(attempt: int, headers: Any = None) -> float:
        asked.append(retry_delay(attempt, headers))
        loaded.set()  # the client was refused while loading: now let the model load, then retry
        wait_for(lambda: httpx.get(urls[0] + "/health").status_code == 200, TIMEOUT, "the model to load")
        return 0.0

    monkeypatch.setattr(remote_module, "retry_delay", let_it_load)
    with serving(build_app(load, ServerConfig(api_keys=(KEY,)), model_name="tiny")) as url:
        urls.append(url)
        try:
            kwargs: dict[str, Any] = dict(base_url=url, api_key=KEY, max_retries=3, max_tokens=4)
            if front_end == "ChatKev":
                answer = ChatKev(**kwargs).invoke("Hello").content
            elif front_end == "KevLLM":
                answer = KevLLM(**kwargs).invoke("Hello")
            else:
                answer = Kev(**kwargs).complete("Hello").text
        finally:
            clear_shared_engines()
    assert isinstance(answer, str) and answer
    assert asked == [5.0]  # refused once while loading; the server asked for 5 s, and that is the wait chosen


@pytest.mark.parametrize("front_end", ["ChatKev", "KevLLM", "Kev"])
def test_max_retries_without_base_url_is_refused_saying_why(front_end: str) -> None:
    from kev_integrations.langchain import ChatKev, KevLLM
    from kev_integrations.llamaindex import Kev

    model_class = {"ChatKev": ChatKev, "KevLLM": KevLLM, "Kev": Kev}[front_end]
    with pytest.raises(ValueError, match="max_retries=2 needs base_url=.*no request goes over a network"):
        model_class(max_retries=2)
    with pytest.raises(ValueError, match="max_retries=-1 is not allowed"):
        model_class(base_url="http://127.0.0.1:1", max_retries=-1)
    assert model_class(max_retries=0).max_retries == 0  # no retries: true in-process too


def test_the_wait_follows_the_openai_rule() -> None:
    assert retry_delay(0, {"retry-after": "3"}) == 3.0
    assert retry_delay(0, {"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    date = "Wed, 21 Oct 2015 07:28:30 GMT"
    assert retry_after({"retry-after": date}, now=lambda: 1445412480.0) == 30.0  # an HTTP date, 30 s ahead
    assert retry_delay(0, {"retry-after": date}, jitter=lambda: 0.0) == BASE_DELAY_S  # in the past: backoff
    assert retry_delay(1, {"retry-after": "120"}, jitter=lambda: 0.0) == 2 * BASE_DELAY_S  # too long: backoff
    assert retry_delay(10, {"retry-after": "soon"}, jitter=lambda: 0.0) == MAX_DELAY_S
    assert retry_delay(3, None, jitter=lambda: 1.0) == 0.75 * BASE_DELAY_S * 8  # jitter takes up to a quarter
    with pytest.raises(ValueError, match="max_retries=True is not allowed"):
        RemoteEngine("http://127.0.0.1:1", max_retries=True)  # type: ignore[arg-type]
