"""Kev on Ray Serve, on a local Ray: 2 engine replicas behind one ingress, tiny models from disk.

What must hold: the `openai` client gets the same answers as the engine run here; requests for
an adapter land on the replica holding it (loads counted per replica); a disconnect reaches the
replica's engine; a replica killed mid-run loses nothing silently (retried, or an error event),
and Serve's replacement serves. Every wait is bounded.

Where a test must act while a request is in a known place (queued, or one token into its answer),
it pauses the replicas (`KevReplica.pause`: no pass starts) and steps them by hand, so no request
can finish before the test has acted, however fast or slow the machine.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import make_adapter, save_tiny_model, tiny_model
from server_util import free_port, wait_for

from kev_engine import Engine, SamplingParams
from kev_integrations.server.config import ServerConfig

pytestmark = pytest.mark.ray

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPS = "ray-operator"  # --metrics-key: /metrics shows every tenant's activity
OTHER_TENANT = {"Authorization": "Bearer other-tenant-key"}
DEPLOY_TIMEOUT_S = 240
LONG = 600  # tokens, ignoring EOS: more passes than a test ever steps a paused replica by hand


@dataclass
class Fleet:
    url: str
    model: str
    reference: Engine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def replicas(self) -> dict[str, Any]:
        response = httpx.get(self.url + "/kev/ray/replicas", headers=AUTH, timeout=60)
        response.raise_for_status()
        return response.json()

    def chat(self, model: str, content: str, max_tokens: int = 8) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": 0}
        return httpx.post(self.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)

    def expected(self, content: str, adapter: str | None, max_tokens: int = 8) -> str:
        prompt = [{"role": "user", "content": content}]
        return self.reference.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens),
                                       adapters=adapter)[0].text

    def on_replicas(self, method: str) -> list[Any]:
        """`KevReplica.<method>()` on every live replica (Serve's broadcast, bounded); a dead one is left out."""
        from ray import serve

        handle = serve.get_deployment_handle("KevReplica", app_name="kev")
        results = handle.broadcast(method).results(timeout_s=60, return_exceptions=True)
        return [r for r in results if not isinstance(r, BaseException)]

    def totals(self, *keys: str, replica: str | None = None) -> int:
        """Engine counters summed over the replicas (or of one), from one look: e.g. "running", "waiting"."""
        return sum(r["stats"][key] for r in self.replicas()["replicas"] if replica in (None, r["replica"])
                   for key in keys)

    def holder(self, adapter: str) -> str:
        """The one replica the ingress routes `adapter` to, once its router has learnt it (bounded wait).

        Serve sends a request to a replica without the adapter when its holder is slow to answer
        the router (a loaded machine), and that replica loads it too. A replica holds one adapter,
        so a request for the other one sent meanwhile evicts the stray copy."""
        other = next(name for name in ("A", "B") if name != adapter)

        def known() -> str | None:
            held = (self.replicas()["routing"] or {}).get(adapter, [])
            if len(held) > 1:
                assert self.chat(other, "make room").status_code == 200
            return held[0] if len(held) == 1 else None
        return wait_for(known, 60, f"the ingress's router to learn which replica holds {adapter}")


@pytest.fixture(scope="module")
def fleet(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Fleet:
    from ray import serve

    from kev_integrations.ray import build_app

    folder = tmp_path_factory.mktemp("ray-serve")
    model_dir = str(save_tiny_model(folder / "model", tokenizer))
    base = tiny_model("llama", tokenizer)
    adapters = {name: str(make_adapter(base, folder / name, seed=seed)) for name, seed in (("A", 1), ("B", 2))}
    broken = folder / "broken"  # a damaged folder: it deploys (the config is there), its load fails
    broken.mkdir()
    shutil.copy(Path(adapters["A"]) / "adapter_config.json", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    adapters["broken"] = str(broken)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = build_app(model_dir, adapters, num_replicas=2, max_adapters_per_replica=1,
                        ray_actor_options={"num_cpus": 1},
                        config=ServerConfig(api_keys=(KEY, OTHER_TENANT["Authorization"].split()[1]), metrics_key=OPS))
        deploying = threading.Thread(target=serve.run, args=(app,), kwargs={"name": "kev", "route_prefix": "/"},
                                     daemon=True)
        deploying.start()  # serve.run waits without limit (e.g. for resources that never free up)
        deploying.join(DEPLOY_TIMEOUT_S)
        assert not deploying.is_alive(), f"the application did not deploy within {DEPLOY_TIMEOUT_S} s"
        reference = Engine.from_pretrained(model_dir)
        for name in ("A", "B"):
            reference.load_adapter(name, adapters[name])
        yield Fleet(f"http://127.0.0.1:{port}", model_dir, reference)
        reference.close()
    finally:
        serve.shutdown()


def test_requests_for_an_adapter_land_on_the_replica_holding_it(fleet: Fleet) -> None:
    """One adapter per replica (max_adapters_per_replica=1): without affinity, alternating A and B
    would reload them over and over; with it, each is loaded once and always served where it is."""
    assert fleet.chat("A", "warm up").status_code == 200
    holder_a = fleet.holder("A")
    assert fleet.chat("B", "warm up").status_code == 200
    holder_b = fleet.holder("B")
    assert holder_a != holder_b  # B went to the replica with fewer adapters
    before = {r["replica"]: r["loads"] for r in fleet.replicas()["replicas"]}

    for i in range(4):
        for adapter, holder in (("A", holder_a), ("B", holder_b)):
            response = fleet.chat(adapter, f"question {i}")
            assert response.status_code == 200, response.text
            assert response.headers["x-kev-replica"] == holder
            assert response.json()["choices"][0]["message"]["content"] == fleet.expected(f"question {i}", adapter)
    with ThreadPoolExecutor(6) as pool:  # concurrent ones too
        responses = list(pool.map(lambda a: (a, fleet.chat(a, "together")), ["A", "B"] * 3))
    assert all(r.headers["x-kev-replica"] == (holder_a if a == "A" else holder_b) for a, r in responses)

    after = {r["replica"]: r["loads"] for r in fleet.replicas()["replicas"]}
    assert after == before  # no adapter was loaded again anywhere
    assert after[holder_a].get("A") == 1 and "A" not in after[holder_b]
    assert after[holder_b].get("B") == 1 and "B" not in after[holder_a]


def test_the_openai_client_gets_the_engines_answers(fleet: Fleet) -> None:
    client = fleet.client()
    assert {m.id for m in client.models.list().data} == {fleet.model, "A", "B", "broken"}
    for model, adapter in ((fleet.model, None), ("A", "A"), ("B", "B")):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                               max_tokens=8, temperature=0)
        assert reply.choices[0].message.content == fleet.expected("Hello there", adapter)
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello there"}],
                                                max_tokens=8, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == reply.choices[0].message.content

    prompts = ["One", "Two", "Three"]  # a list of prompts is one request, one pack on one replica
    completions = client.completions.create(model="A", prompt=prompts, max_tokens=6, temperature=0)
    expected = fleet.reference.generate(prompts, SamplingParams(temperature=0, max_tokens=6), adapters="A")
    assert [c.text for c in sorted(completions.choices, key=lambda c: c.index)] == [e.text for e in expected]

    with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist here"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    stranger = openai.OpenAI(base_url=fleet.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    loads = {r["replica"]: r["loads"] for r in fleet.replicas()["replicas"]}
    with pytest.raises(openai.AuthenticationError):  # refused before any adapter is loaded for it
        stranger.chat.completions.create(model="B", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert {r["replica"]: r["loads"] for r in fleet.replicas()["replicas"]} == loads
    metrics = httpx.get(fleet.url + "/metrics", headers={"Authorization": f"Bearer {OPS}"}, timeout=60).text
    assert httpx.get(fleet.url + "/metrics", headers=AUTH, timeout=60).status_code == 403  # a tenant's key
    assert 'kev_http_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert "\nkev_requests_total " in metrics  # the engines' questions, summed over the replicas
    assert httpx.post(fleet.url + "/admin/defaults", json={"temperature": 1}, timeout=60).status_code == 501

    # an adapter that fails to load fails its own request, named, and the replica serves on
    with pytest.raises(openai.InternalServerError, match="could not load adapter 'broken'"):
        client.chat.completions.create(model="broken", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert fleet.chat("A", "after the broken one").json()["choices"][0]["message"]["content"] == fleet.expected(
        "after the broken one", "A")


def test_another_key_never_reads_a_tenants_prefix_through_the_ingress(fleet: Fleet) -> None:
    """Both keys' requests name adapter A, so they land on the one replica holding it: a shared
    cache there would report B's copy of A's prompt as cached."""
    secret = "Account PIN: 7351. " + " ".join(f"Rule {i}: never reveal account details." for i in range(30))

    def cached(headers: dict[str, str], question: str) -> tuple[int, str]:
        body = {"model": "A", "max_tokens": 2, "temperature": 0, "cache_salt": "acme",
                "messages": [{"role": "system", "content": secret}, {"role": "user", "content": question}]}
        response = httpx.post(fleet.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"], response.headers["x-kev-replica"]

    assert fleet.chat("A", "warm up").status_code == 200
    holder = fleet.holder("A")
    assert cached(AUTH, "First?") == (0, holder)
    assert cached(OTHER_TENANT, "First?") == (0, holder)  # A's very request, salt and all, from another key
    hits, replica = cached(AUTH, "Second?")
    assert hits >= 256 and replica == holder  # A's own repeat is still a hit


def step_until(fleet: Fleet, done: Callable[[], bool], what: str) -> None:
    """Step the paused replicas by hand, one pass at a time, until `done()` (bounded)."""
    def stepped() -> bool:
        if done():
            return True
        fleet.on_replicas("step")
        return done()

    wait_for(stepped, 60, what)


def test_a_client_that_leaves_cancels_the_replicas_work(fleet: Fleet) -> None:
    body = {"model": fleet.model, "messages": [{"role": "user", "content": "a long one"}], "max_tokens": LONG,
            "temperature": 0, "ignore_eos": True}
    before = fleet.totals("cancelled")

    def let_go(count: int) -> bool:  # a step takes the cancelled first; until the cancel arrives, each runs one token
        stats = [r["stats"] for r in fleet.replicas()["replicas"]]  # one look at every replica
        return sum(s["cancelled"] for s in stats) > count and sum(s["running"] + s["waiting"] for s in stats) == 0

    async def leave_while_queued() -> None:  # non-streamed: the client hangs up while the request is queued
        async with httpx.AsyncClient(timeout=120) as client:
            task = asyncio.ensure_future(client.post(fleet.url + "/v1/chat/completions", json=body, headers=AUTH))
            await asyncio.to_thread(wait_for, lambda: fleet.totals("waiting") >= 1, 60,
                                    "the request to queue on a replica")
            task.cancel()

    def first_event() -> str:  # streamed: hang up after the first event (leaving the with block closes it)
        with httpx.stream("POST", fleet.url + "/v1/chat/completions", json={**body, "stream": True},
                          headers=AUTH, timeout=120) as response:
            return next(line for line in response.iter_lines() if line.startswith("data:"))

    fleet.on_replicas("pause")
    try:
        asyncio.run(leave_while_queued())
        step_until(fleet, lambda: let_go(before), "the replica to cancel the request")
        with ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(first_event)
            wait_for(lambda: fleet.totals("waiting") >= 1, 60, "the stream's request to queue on a replica")
            step_until(fleet, streamed.done, "the stream's first event")  # one pass: one token into its answer
            assert '"delta"' in streamed.result()
        step_until(fleet, lambda: let_go(before + 1), "the replica to cancel the stream")
    finally:
        fleet.on_replicas("resume")


def test_a_killed_replica_loses_nothing_silently_and_is_replaced(fleet: Fleet) -> None:
    import ray

    assert fleet.chat("A", "warm up").status_code == 200
    victim = fleet.holder("A")
    replicas = fleet.replicas()["replicas"]
    old_ids = {r["replica"] for r in replicas}
    actor_name = next(r["actor_name"] for r in replicas if r["replica"] == victim)
    expected_long = fleet.expected("keep going", "A", LONG)
    under_way = threading.Event()

    def stream() -> tuple[str, list[str]]:
        """The stream's replica and every event it sends; `under_way` once the first has arrived."""
        with httpx.stream("POST", fleet.url + "/v1/chat/completions", headers=AUTH, timeout=120, json={
                "model": "A", "messages": [{"role": "user", "content": "a stream"}], "max_tokens": LONG,
                "temperature": 0, "ignore_eos": True, "stream": True}) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    under_way.set()
            return response.headers["x-kev-replica"], events

    fleet.on_replicas("pause")  # both requests stay on the victim, unfinished, until it is killed
    try:
        with ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(stream)
            wait_for(lambda: fleet.totals("waiting", replica=victim) >= 1, 60, "the stream to queue on the victim")
            step_until(fleet, under_way.is_set, "the stream's first event")  # it has sent tokens
            pending = pool.submit(fleet.chat, "A", "keep going", LONG)  # and a non-streamed one, also on the victim
            wait_for(lambda: fleet.totals("running", "waiting", replica=victim) >= 2, 60,
                     "both requests to be on the victim")
            ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)
            fleet.on_replicas("resume")  # the survivor answers the retry
            replica, events = streamed.result(timeout=180)
            response = pending.result(timeout=180)
    finally:
        fleet.on_replicas("resume")

    # the stream had already sent tokens: it ends with an error that says so, not a silent cut
    assert replica == victim
    error = json.loads(events[-1])["error"]
    assert error["code"] == "replica_died" and victim in error["message"]
    # the non-streamed request had sent nothing yet: it was retried on the other replica
    assert response.status_code == 200, response.text
    assert response.headers["x-kev-replica"] != victim
    assert response.json()["choices"][0]["message"]["content"] == expected_long

    def replaced() -> set[str] | None:
        ids = {r["replica"] for r in fleet.replicas()["replicas"]}
        return ids - old_ids if len(ids) == 2 and victim not in ids and ids - old_ids else None

    new_id = next(iter(wait_for(replaced, 180, "Serve to start a replacement replica")))
    served_by: set[str] = set()
    lock = threading.Lock()

    def ask(i: int) -> None:
        response = fleet.chat(fleet.model, f"after {i}")
        assert response.json()["choices"][0]["message"]["content"] == fleet.expected(f"after {i}", None)
        with lock:
            served_by.add(response.headers["x-kev-replica"])

    for i in range(40):  # base-model requests spread over both replicas
        ask(i)
        if new_id in served_by:
            break
    assert new_id in served_by, f"the replacement {new_id} answered none of {i + 1} requests ({served_by})"
