"""The pieces of Kev on Ray that need no cluster: the in-process ASGI bridge a replica serves
through, and how the ingress reads which adapters a request names. (Serve itself: test_ray_serve.py.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from server_util import wait_for

from kev_engine import Engine, SamplingParams
from kev_integrations.ray.asgi import HTTPRequest, ResponseStart, run_asgi
from kev_integrations.server.app import build_app


def _chat(body: dict[str, Any]) -> HTTPRequest:
    return HTTPRequest("POST", "/v1/chat/completions", headers=[(b"content-type", b"application/json")],
                       body=json.dumps(body).encode())


async def _collect(app: Any, request: HTTPRequest) -> tuple[ResponseStart, bytes]:
    pieces = [piece async for piece in run_asgi(app, request, "r1")]
    start, *chunks = pieces
    assert isinstance(start, ResponseStart) and start.replica == "r1"
    return start, b"".join(chunks)  # type: ignore[arg-type]


def test_the_bridge_relays_the_apps_answers(tiny_engine: Engine) -> None:
    app = build_app(tiny_engine)  # no lifespan runs: a ready engine is served at once
    messages = [{"role": "user", "content": "Hello"}]
    expected = tiny_engine.generate([messages], SamplingParams(temperature=0, max_tokens=6))[0].text

    start, body = asyncio.run(_collect(app, _chat({"model": "tiny-llama", "messages": messages, "max_tokens": 6})))
    assert start.status == 200 and start.header("content-type") == "application/json"
    assert json.loads(body)["choices"][0]["message"]["content"] == expected

    start, body = asyncio.run(_collect(app, _chat({"model": "tiny-llama", "messages": messages, "max_tokens": 6,
                                                   "stream": True})))
    assert (start.header("content-type") or "").startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == expected

    start, body = asyncio.run(_collect(app, _chat({"model": "nope", "messages": messages})))
    assert start.status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_leaving_the_bridge_early_cancels_the_engine_request(tiny_engine: Engine, stream: bool) -> None:
    """What a replica does when Ray cancels its call: the app sees a disconnect and drops the work."""
    app = build_app(tiny_engine)
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 900,
            "stream": stream}

    async def leave() -> None:
        pieces = run_asgi(app, _chat(body))
        if stream:
            assert isinstance(await pieces.__anext__(), ResponseStart)
            await pieces.__anext__()  # the first event: the request runs
        else:
            getter = asyncio.ensure_future(pieces.__anext__())
            await asyncio.to_thread(_wait_running, tiny_engine)
            getter.cancel()  # as Ray cancels a replica's call
            with pytest.raises(asyncio.CancelledError):
                await getter
        await pieces.aclose()
        # the engine drops a cancelled request at its next pass; the loop lives on meanwhile, as a
        # replica's does (a closed loop would fail the request's text callback instead)
        await asyncio.to_thread(wait_for, lambda: tiny_engine.stats()["running"] == 0, 30,
                                "the engine to drop the request")

    asyncio.run(asyncio.wait_for(leave(), 60))
    stats = tiny_engine.stats()
    assert stats["cancelled"] == 1 and stats["generated_tokens"] < 900


def _wait_running(engine: Engine) -> None:
    wait_for(lambda: engine.stats()["running"] == 1, 30, "the request to run")


def test_the_ingress_routes_by_the_adapter_a_body_names() -> None:
    from kev_integrations.ray.serve import requested_adapters  # imports ray (a test dependency)

    catalog = {"sql", "law"}
    chat = "/v1/chat/completions"
    assert requested_adapters(chat, b'{"model": "sql", "messages": []}', catalog) == ["sql"]
    assert requested_adapters(chat, b'{"model": "base", "adapter": "law"}', catalog) == ["law"]
    assert requested_adapters("/v1/completions", b'{"model": "law", "adapter": "law"}', catalog) == ["law"]
    assert requested_adapters(chat, b'{"model": "unknown"}', catalog) == []  # the replica's app refuses it
    assert requested_adapters(chat, b"not json", catalog) == []
    assert requested_adapters(chat, b"[1, 2]", catalog) == []
    assert requested_adapters("/v1/models", b'{"model": "sql"}', catalog) == []  # nothing to route
    generate = json.dumps({"requests": [{"prompt": "a", "adapter": "law"}, {"prompt": "b"},
                                        {"prompt": "c", "adapter": "sql"}, {"prompt": "d", "adapter": "law"}]})
    assert requested_adapters("/kev/v1/generate", generate.encode(), catalog) == ["law", "sql"]


def test_an_adapter_the_lru_drops_stays_for_the_requests_using_it(tiny_engine: Engine, tokenizer: Any,
                                                                   tmp_path: Any) -> None:
    """Serve's LRU may drop an adapter a request still uses: the engine keeps it until that request
    ends, and asking for it meanwhile takes it back without a reload (a reload would be refused)."""
    from conftest import make_adapter, tiny_model

    from kev_integrations.ray.leases import AdapterLeases

    path = str(make_adapter(tiny_model("llama", tokenizer), tmp_path / "a", seed=1))
    leases = AdapterLeases(tiny_engine, {"a": path})
    cached = [asyncio.run(leases.hold("a"))]  # what Serve's LRU keeps (a dropped one is garbage: evicted)
    assert tiny_engine.adapters == ["a"] and leases.loads["a"] == 1

    leases.acquire("a")  # a request uses it ...
    cached.pop().__del__()  # ... when the LRU drops it (what Serve calls on eviction)
    assert tiny_engine.adapters == ["a"]  # still served
    cached.append(asyncio.run(leases.hold("a")))  # an LRU miss meanwhile: taken back, not read again
    assert leases.loads["a"] == 1
    leases.release(["a"])
    assert tiny_engine.adapters == ["a"]  # taken back: it stays

    leases.acquire("a")
    cached.pop().__del__()
    assert tiny_engine.adapters == ["a"]
    leases.release(["a"])  # dropped while in use: the last request out unloads it
    assert tiny_engine.adapters == []
    cached.append(asyncio.run(leases.hold("a")))  # and a later miss loads it afresh
    assert tiny_engine.adapters == ["a"] and leases.loads["a"] == 2

    leases.acquire("a")
    leases.release(["a"])
    cached.pop().__del__()  # dropped while idle: unloaded at once
    assert tiny_engine.adapters == []


def test_a_stream_that_fails_as_a_whole_fails_every_unanswered_request() -> None:
    """A Ray stream cut mid-way ends with one error event without an index (the ingress cannot know
    which requests it carried): RemoteEngine fails each unanswered future with its message."""
    import functools
    from concurrent.futures import Future
    from types import SimpleNamespace

    from kev_engine import KevError
    from kev_engine.core.delivery import Delivery
    from kev_integrations.remote import RemoteEngine, _Pending

    batch = [_Pending("a", SamplingParams(), None, None, Future()), _Pending("b", SamplingParams(), None, None,
                                                                            Future())]
    batch[0].future.set_result("answered")
    event = {"error": {"message": "the replica answering this stream (r1) died midway", "code": "replica_died"}}
    client = SimpleNamespace(base_url="http://x", _delivery=Delivery("test"))  # what _event uses of a client
    client._resolve = functools.partial(RemoteEngine._resolve, client)  # type: ignore[arg-type]
    RemoteEngine._event(client, batch, event)  # type: ignore[arg-type]
    with pytest.raises(KevError, match="r1\\) died midway"):
        batch[1].future.result(timeout=30)  # resolved on a delivery thread
    assert batch[0].future.result() == "answered"
