"""Kev on Ray Serve: N engine replicas behind one OpenAI-compatible endpoint, routed by adapter.

Data flow: client → Serve's HTTP proxy → `KevIngress` (one light actor) → a `KevReplica`,
which runs one `Engine` behind the very app `kev serve` runs (`kev_integrations.server`), so
the API, its keys, limits, constraints, tool calls, streaming and Kev's own endpoints are the
same by construction. The ingress only reads which adapters a body names and relays bytes.

Adapter affinity: OpenAI clients pick an adapter by the body's `model` (or `adapter`), which
Serve's proxy never reads, so the ingress does, and calls the replicas with
``multiplexed_model_id=<adapter>``. Serve then prefers a replica that already holds it; each
replica loads adapters on demand through ``@serve.multiplexed`` (an LRU of
`max_adapters_per_replica`), so an adapter lives on the replicas its traffic needs, not on all.
Mixed-adapter packing stays inside each replica's engine (Serve's own batcher splits by id).

Tenants: the ingress relays the caller's ``Authorization`` header, and each replica's app derives
the tenant's prefix-cache namespace from it (`kev_integrations.server.tenants`), as `kev serve`
does: every replica keeps API keys apart in its own cache.

Failure: a replica that dies before the ingress has relayed any byte of its answer is retried
on another replica (`retries` times); a stream that dies midway ends with an error event that
says so — never a silently truncated answer.
"""

# No `from __future__ import annotations`: Serve's class-based FastAPI views must see `Request` itself.
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from kev_integrations.server.app import check_key, check_metrics_key
from kev_integrations.server.config import ServerConfig
from kev_integrations.server.errors import APIError
from kev_integrations.server.limits import body_too_large, body_too_slow
from kev_integrations.server.metrics import Metrics, fleet_stats
from kev_integrations.server.responses import sse

from .asgi import HTTPRequest, ResponseStart, run_asgi
from .leases import AdapterLeases

REPLICA_GONE = (RayActorError, ReplicaUnavailableError)  # the replica died or left: another may answer
BROADCAST_TIMEOUT_S = 30.0  # /metrics and /kev/ray/replicas ask every replica
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/kev/v1/generate")


def requested_adapters(path: str, body: bytes, catalog: Collection[str]) -> list[str]:
    """The catalog adapters a request names, the one to route by first. Reads, never refuses:
    a malformed body goes on to a replica, whose app answers it with the usual 400."""
    if path not in ROUTED_PATHS:
        return []
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return []
    if not isinstance(data, dict):
        return []
    if path == "/kev/v1/generate":
        requests = data.get("requests")
        names = [r.get("adapter") for r in requests if isinstance(r, dict)] if isinstance(requests, list) else []
    else:
        names = [data.get("adapter"), data.get("model")]
    found: list[str] = []
    for name in names:
        if isinstance(name, str) and name in catalog and name not in found:
            found.append(name)
    return found


class KevReplica:
    """One engine behind the `kev serve` app; adapters from a catalog, loaded on demand."""

    def __init__(self, model: str | None, adapters: dict[str, str], config: ServerConfig, model_name: str,
                 max_adapters: int, engine_kwargs: dict[str, Any]) -> None:
        from kev_engine import Engine
        from kev_integrations.server.app import build_app as build_server_app

        for name, path in adapters.items():  # a wrong path fails the deployment now, not a request later
            if not (Path(path) / "adapter_config.json").is_file():
                raise FileNotFoundError(f"adapter {name!r}: no {path}/adapter_config.json on this node; every node "
                                        "needs each adapter folder at the same path")
        self.catalog = dict(adapters)
        self.engine = Engine.from_pretrained(model, **engine_kwargs)
        self.app = build_server_app(self.engine, config, model_name, adapter_names=lambda: list(self.catalog))
        replica_id = serve.get_replica_context().replica_id
        self.replica, self.actor_name = replica_id.unique_id, replica_id.to_full_id_str()
        self.leases = AdapterLeases(self.engine, self.catalog)

        async def hold(name: str) -> Any:  # a plain function: Serve keeps its LRU on the function object
            return await self.leases.hold(name)

        self.max_adapters = max_adapters
        self._hold = serve.multiplexed(max_num_models_per_replica=max_adapters)(hold)
        self._paused: contextlib.ExitStack | None = None

    async def forward(self, request: HTTPRequest, adapters: list[str]) -> AsyncIterator[ResponseStart | bytes]:
        """The app's response to `request`, after loading the adapters it names (routed here by the first)."""
        if len(adapters) > self.max_adapters:
            error = APIError(400, f"this request names {len(adapters)} adapters {adapters}; a replica holds at most "
                             f"{self.max_adapters} at once (max_adapters_per_replica)", param="adapter")
            for piece in self._error_response(error):
                yield piece
            return
        held: list[str] = []
        try:
            for name in adapters:
                self.leases.acquire(name)  # before the load: an eviction meanwhile waits for this request
                held.append(name)
                try:  # shielded: a client leaving mid-load must not leave Serve's LRU and the engine disagreeing
                    await asyncio.shield(self._hold(name))
                except Exception as exc:  # a damaged folder: this request fails, the replica serves on
                    error = APIError(500, f"could not load adapter {name!r} from {self.catalog[name]}: "
                                     f"{type(exc).__name__}: {exc}", type="server_error", param="model")
                    for piece in self._error_response(error):
                        yield piece
                    return
            async for piece in run_asgi(self.app, request, self.replica):
                yield piece
        finally:
            self.leases.release(held)

    def _error_response(self, error: APIError) -> list[ResponseStart | bytes]:
        return [ResponseStart(error.status, [(b"content-type", b"application/json")], self.replica),
                json.dumps(error.body()).encode()]

    def info(self) -> dict[str, Any]:
        """This replica as operators (and tests) see it: who it is, what it loaded, what it has served."""
        import torch

        return {"replica": self.replica, "actor_name": self.actor_name, "loads": dict(self.leases.loads),
                "adapters": self.engine.adapters, "torch_threads": torch.get_num_threads(),
                "stats": self.engine.stats(), "metrics": self.app.state.kev.metrics.snapshot()}

    def pause(self) -> None:
        """Start no pass until `resume()`; requests still arrive and queue, and a pass under way
        finishes (`Engine.hold`). For operators holding a replica still, and tests that must act
        while a request is in a known place. Pausing a paused replica changes nothing."""
        if self._paused is None:
            self._paused = contextlib.ExitStack()
            self._paused.enter_context(self.engine.hold())

    def resume(self) -> None:
        if self._paused is not None:
            self._paused.close()
            self._paused = None

    def step(self) -> int:
        """One pass by hand, paused or not (`Engine.step`): the number of tokens it ran."""
        return self.engine.step()

    def check_health(self) -> None:
        """Serve restarts a replica whose engine has stopped."""
        if self.engine.closed:
            raise RuntimeError("the engine is closed")

    def __del__(self) -> None:  # Serve calls this when it stops the replica
        engine = getattr(self, "engine", None)
        if engine is not None and not engine.closed:
            engine.close(timeout=30)


api = FastAPI(title="Kev on Ray", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def _response_headers(start: ResponseStart) -> list[tuple[bytes, bytes]]:
    return [*start.headers, (b"x-kev-replica", start.replica.encode())]


async def _rest(call: DeploymentResponseGenerator, first: bytes, replica: str) -> AsyncIterator[bytes]:
    """The rest of a relayed stream; a replica lost midway ends it with an error event, not silence."""
    try:
        if first:
            yield first
        try:
            async for chunk in call:
                yield bytes(chunk)
        except REPLICA_GONE as exc:
            error = APIError(502, f"the replica answering this stream ({replica}) died midway "
                             f"({type(exc).__name__}); the answer is incomplete, retry the request",
                             type="server_error", code="replica_died")
            yield sse(error.body()).encode()
        except Exception as exc:
            error = APIError(500, f"the replica answering this stream ({replica}) failed midway "
                             f"({type(exc).__name__}: {_first_line(exc)}); the answer is incomplete",
                             type="server_error")
            yield sse(error.body()).encode()
    finally:  # the client left, or we are done: the replica stops computing for nobody
        call.cancel()


# Everything KevIngress uses is defined above it: `serve.ingress` captures the class with the
# module globals that exist when it runs.
@serve.ingress(api)
class KevIngress:
    """Reads which adapter a request names, routes it to a replica holding it, relays the answer."""

    def __init__(self, replicas: DeploymentHandle, catalog: list[str], config: ServerConfig, retries: int) -> None:
        self.replicas, self.catalog, self.config, self.retries = replicas, frozenset(catalog), config, retries

    @api.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """The fleet's counters and engine stats, summed over every replica running now."""
        check_metrics_key(request, self.config)
        infos = await self._replica_infos()
        stats = fleet_stats([i["stats"] for i in infos]) if infos else None
        text = Metrics.merged([i["metrics"] for i in infos]).render(stats)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @api.get("/kev/ray/replicas")
    async def replicas_view(self, request: Request) -> JSONResponse:
        """Each replica's id, the adapters it holds and has loaded, and its engine's stats."""
        check_key(request, self.config.api_keys, "/kev/ray")
        infos = await self._replica_infos()
        return JSONResponse({"replicas": [{k: v for k, v in i.items() if k != "metrics"} for i in infos],
                             "routing": self._routing()})

    def _routing(self) -> dict[str, list[str]] | None:
        """Which replicas this ingress's router believes hold each adapter — where it sends that
        adapter's requests. Read from Ray's internals (no public API has it): None if they moved."""
        try:
            router = self.replicas._router._asyncio_router.request_router  # type: ignore[union-attr]
            held = router._multiplexed_model_id_to_replica_ids
            return {name: sorted(r.unique_id for r in ids) for name, ids in held.items() if ids}
        except AttributeError:
            return None

    @api.api_route("/admin/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def admin(self, rest: str) -> JSONResponse:
        raise APIError(501, "admin endpoints are not served on Ray: a change made on one replica would not reach "
                       "the others or replicas started later. Declare adapters in build_app(adapters=...) "
                       "(or --adapter) and the default temperature with KEV_TEMPERATURE, then redeploy",
                       type="not_implemented")

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def proxy(self, path: str, request: Request) -> Response:
        if path.startswith(("v1/", "kev/v1/")):  # the key first: no adapter is loaded for a stranger
            check_key(request, self.config.api_keys, "/kev/v1" if path.startswith("kev/") else "/v1")
        body = await self._body(request)
        forwarded = HTTPRequest(request.method, "/" + path, request.url.query.encode(), list(request.headers.raw),
                                body, (request.client.host, request.client.port) if request.client else None)
        return await self._relay(forwarded, requested_adapters(forwarded.path, body, self.catalog))

    async def _body(self, request: Request) -> bytes:
        """The body, refused (413) the moment it passes the limit: chunked bodies declare no length;
        and a 408 if it has not all arrived within the config's `body_timeout_s`."""
        limit = self.config.max_body_bytes
        too_large = body_too_large(limit)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > limit:
                    raise too_large

        try:
            await asyncio.wait_for(read(), self.config.body_timeout_s)
        except asyncio.TimeoutError:
            raise body_too_slow(self.config.body_timeout_s) from None
        return bytes(body)

    async def _replica_infos(self) -> list[dict[str, Any]]:
        """`info()` of every replica that answers; one that just died is left out, not an error."""
        try:
            results = await self.replicas.broadcast("info").results_async(timeout_s=BROADCAST_TIMEOUT_S,
                                                                           return_exceptions=True)
        except TimeoutError:
            raise APIError(504, f"a replica did not answer within {BROADCAST_TIMEOUT_S:g} s (busy or stopping); "
                           "retry", type="timeout_error") from None
        return [r for r in results if isinstance(r, dict)]

    async def _relay(self, request: HTTPRequest, adapters: list[str]) -> Response:
        """Send to a replica (by adapter), retrying on another if it dies before anything was relayed."""
        failures: list[str] = []
        for _ in range(self.retries + 1):
            call: DeploymentResponseGenerator = self.replicas.options(  # type: ignore[assignment]
                stream=True, multiplexed_model_id=adapters[0] if adapters else "").forward.remote(request, adapters)
            try:
                start = await call.__anext__()
                assert isinstance(start, ResponseStart)
                if (start.header("content-type") or "").startswith("text/event-stream"):
                    first = await anext(call, b"")  # a death before the first event is still retried
                    response: Response = StreamingResponse(_rest(call, first, start.replica),
                                                           status_code=start.status)
                else:
                    response = Response(b"".join([bytes(chunk) async for chunk in call]), status_code=start.status)
                response.raw_headers = _response_headers(start)
                return response
            except BaseException as exc:
                call.cancel()  # whatever happened, the replica stops working on this call
                if not isinstance(exc, Exception):  # the client left: Serve cancels this handler
                    raise
                if not isinstance(exc, REPLICA_GONE):
                    raise self._refusal(exc) from None
                failures.append(f"{type(exc).__name__}: {_first_line(exc)}")
        raise APIError(503, f"the replica answering this request died, {len(failures)} time(s): {failures}; "
                       "retry once the deployment has replaced it", type="server_error", code="replica_unavailable",
                       headers={"Retry-After": "5"})

    def _refusal(self, exc: Exception) -> APIError:
        """A failed call other than a lost replica, in OpenAI's shape (never a bare 500)."""
        if isinstance(exc, BackPressureError):
            return APIError(429, "every replica's queue is full; retry later", type="rate_limit_error",
                            code="queue_full", headers={"Retry-After": str(self.config.retry_after_s)})
        if isinstance(exc, DeploymentUnavailableError):
            return APIError(503, f"no replica is available: {_first_line(exc)}", type="server_error",
                            code="replica_unavailable", headers={"Retry-After": "5"})
        return APIError(500, f"the replica failed: {type(exc).__name__}: {_first_line(exc)}", type="server_error")


def default_actor_options(replicas: int) -> dict[str, float]:
    """One GPU per replica where the cluster has GPUs; else each node's CPUs shared out between
    the replicas it will hold — Ray sets a CPU replica's torch threads to its `num_cpus`, so 1
    would mean 1 thread. Refuses what cannot be placed (Serve would wait for it for ever)."""
    if not ray.is_initialized():
        ray.init()  # what serve.run would do: RAY_ADDRESS's cluster, or a local one
    if ray.cluster_resources().get("GPU", 0) > 0:
        return {"num_gpus": 1}
    cpus = [int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive")]
    per_node = -(-replicas // max(1, len(cpus)))  # replicas per node, rounded up
    share = max(1, min(cpus, default=1) // per_node)
    if sum(c // share for c in cpus) < replicas:
        raise ValueError(f"{replicas} replicas of {share} CPU(s) do not fit this cluster's nodes (CPUs {cpus}); "
                         "use fewer replicas or give ray_actor_options (--cpus-per-replica) with a fraction")
    return {"num_cpus": share}


def build_app(model: str | None = None, adapters: dict[str, str] | None = None, num_replicas: int = 1, *,
              served_model_name: str | None = None, config: ServerConfig | None = None,
              max_adapters_per_replica: int = 4, ray_actor_options: dict[str, Any] | None = None,
              autoscaling_config: dict[str, Any] | None = None, max_ongoing_requests: int | None = None,
              retries: int = 1, graceful_shutdown_timeout_s: float | None = None,
              **engine_kwargs: Any) -> serve.Application:
    """A Serve application: `num_replicas` engines (or `autoscaling_config`) behind one ingress.

    `adapters` maps names to PEFT folders readable on every node. Each replica asks for one GPU
    when the cluster has any, else an equal share of its CPUs (`default_actor_options`), unless
    `ray_actor_options` names `num_cpus` or `num_gpus` (its other keys, e.g. a `runtime_env`, are
    added to the default).
    `max_ongoing_requests` (default: the config's `max_queued`) is how many requests Serve
    sends one replica at once: high, because the engine packs what arrives together — Serve's
    default of 5 would starve the packing; past it, up to `max_queued` more wait in Serve's queue,
    and the rest get a 429. `retries`: how many other replicas a request is sent to when its
    replica dies before anything was relayed (a request that itself kills replicas could take
    down that many more, hence 1). `graceful_shutdown_timeout_s` is how long a stopping replica
    lets running requests finish. `engine_kwargs` go to `Engine.from_pretrained`.
    """
    from kev_engine import EMBEDDED_NAME

    adapters = dict(adapters or {})
    config = config or ServerConfig()
    name = served_model_name or model or EMBEDDED_NAME
    if name in adapters:
        raise ValueError(f"adapter name {name!r} is the served model's name; give the adapter another name")
    if max_adapters_per_replica < 1:
        raise ValueError(f"max_adapters_per_replica={max_adapters_per_replica}; give at least 1")
    if retries < 0:
        raise ValueError(f"retries={retries}; give 0 or more")
    most = autoscaling_config.get("max_replicas", 1) if autoscaling_config is not None else num_replicas
    if ray_actor_options is None or not {"num_cpus", "num_gpus"} & set(ray_actor_options):
        ray_actor_options = {**default_actor_options(most), **(ray_actor_options or {})}
    options: dict[str, Any] = ({"autoscaling_config": autoscaling_config} if autoscaling_config is not None
                               else {"num_replicas": num_replicas})
    ingress_options: dict[str, Any] = {}
    if graceful_shutdown_timeout_s is not None:  # the ingress relays the replicas' last streams: it stops after them
        options["graceful_shutdown_timeout_s"] = graceful_shutdown_timeout_s
        ingress_options["graceful_shutdown_timeout_s"] = graceful_shutdown_timeout_s + 5
    per_replica = max_ongoing_requests or config.max_queued
    replica = serve.deployment(name="KevReplica", ray_actor_options=ray_actor_options, max_ongoing_requests=per_replica,
                               max_queued_requests=config.max_queued, **options)(KevReplica)
    ingress = serve.deployment(name="KevIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=(per_replica + config.max_queued) * most,
                               max_queued_requests=config.max_queued, **ingress_options)(KevIngress)
    return ingress.bind(replica.bind(model, adapters, config, name, max_adapters_per_replica, engine_kwargs),
                        sorted(adapters), config, retries)

