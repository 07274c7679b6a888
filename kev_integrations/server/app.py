"""The OpenAI-compatible HTTP app over one engine (FastAPI).

Where this sits: every request becomes engine work through `submit_many` — a list of prompts
in one /v1/completions request is one group, packed together — and concurrent requests from
any number of clients coalesce in the engine's scheduler like any other callers; each is
announced as it arrives (`Engine.arriving()`), so a burst shares the idle engine's first pass. The HTTP
layer adds what exposing a model needs: keys, limits, backpressure, disconnects, metrics.

- /health answers 503 while the model loads (in a thread, so the server is up meanwhile).
- A client that disconnects — streaming or not — cancels its requests: the engine stops
  computing them at its next pass and frees their KV.
- Past `max_queued` questions in flight a request gets 429 with Retry-After, never a queue
  that grows without bound; a request still running after `request_timeout_s` is cancelled.
- Each API key is a tenant (`tenants`): its own prefix-cache namespace, its own limit of
  requests in flight (`inflight`) and of grammar compiles (`compiles`, in a pool of their own).
- Headers and bodies have deadlines (`header_deadline`, `limits`): slow senders get a 408.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kev_engine import Arrival, Completion, Engine, KevError, on_passing_thread

from .admin import add_admin_routes
from .chat_prompt import cut_forced_call
from .config import ServerConfig
from .echo import echoed_prompts, unanswered
from .endings import Endings
from .errors import APIError, bad_request, engine_error
from .inflight import PerKeyLimit
from .limits import BodyLimit
from .models import add_model_routes
from .native import add_native_routes
from .pieces import Pieces
from .protocol import EngineCall, parse_chat, parse_completion
from .responses import ChunkWriter, chat_response, choices_of, completion_response, sse
from .state import ServerState
from .tenants import Tenant, check_key, matching_key
from .token_prompts import engine_prompts

SHUTDOWN_CLOSE_S = 30.0  # after uvicorn's graceful drain, the engine gets this long to stop


def _route(request: Request) -> str:
    """The metrics label of a request: its route's template (``/admin/adapters/{name}``), never the
    raw path, which a caller could vary without end or fill with quotes."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def check_metrics_key(request: Request, config: ServerConfig) -> None:
    """/metrics shows the whole engine's activity: operators' keys read it, and tenant keys only
    where there is one tenant (several would each see what the others send: prompt lengths, prefix
    hits, the queue). Without any key it is open, like the rest (loopback only)."""
    if not config.api_keys:
        return
    operators = tuple(k for k in (config.metrics_key, config.admin_key) if k)
    tenants = config.api_keys if len(config.api_keys) == 1 else ()
    key = matching_key(request.headers.get("authorization", ""), operators + tenants)
    if key is not None:
        return
    if matching_key(request.headers.get("authorization", ""), config.api_keys) is not None:
        raise APIError(403, "/metrics shows every tenant's activity, so with several API keys a tenant's key "
                       "cannot read it; use the server's --metrics-key (or --admin-key)", type="permission_error",
                       code="metrics_for_operators")
    check_key(request, operators + tenants, "/metrics")  # the usual 401


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:  # "[[[[..." nested past what the parser follows
        raise bad_request("the request body nests JSON arrays or objects too deeply to read; "
                          "no OpenAI request nests more than a few dozen levels") from None
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _refused(futures: list[Future[Completion]], fields: dict[str, str] | None = None) -> None:
    """Requests the engine refused at submission (bad settings, bad constraint) → 400 before any work."""
    for i, future in enumerate(futures):
        if future.done() and not future.cancelled() and future.exception() is not None:
            for other in futures:
                other.cancel()
            raise engine_error(future.exception(), i if len(futures) > 1 else None, fields)  # type: ignore[arg-type]


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the ASGI server sends http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _answers(request: Request, futures: list[Future[Any]], timeout: float,
                   fields: dict[str, str] | None = None, num_prompts: int | None = None) -> list[Any] | None:
    """Wait for every answer; None if the client left first. Leaving or timing out cancels the work.
    An error names its prompt where there are several (`num_prompts`, else one per future); a
    future that fails with an `APIError` (already the request's answer) fails the request with it."""
    gathered: asyncio.Future[list[Any]] = asyncio.gather(
        *(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
    gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # cancelled: no "never retrieved" log
    watcher: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request))
    try:
        waiters: set[asyncio.Future[Any]] = {gathered, watcher}
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself was cancelled (a proxy in front gave up on it)
        for future in futures:
            future.cancel()
        raise
    finally:
        watcher.cancel()
    if gathered not in done:
        for future in futures:
            future.cancel()
        gathered.cancel()
        if watcher in done:
            return None
        raise APIError(504, f"the request did not finish within {timeout:g} s and was cancelled",
                       type="timeout_error", code="timeout")
    results = gathered.result()
    for i, result in enumerate(results):
        if isinstance(result, APIError):
            raise result
        if isinstance(result, BaseException):
            raise engine_error(result, i if (num_prompts or len(results)) > 1 else None, fields)
    return results


async def _events(state: ServerState, call: EngineCall, chat: bool, engine: Engine,
                  started: float, arrival: Arrival) -> AsyncIterator[str]:
    """Server-sent events of one streamed request; closing the stream cancels its requests.

    The caller has taken the request's queue places; the stream gives them back when it ends.
    """
    pieces = Pieces(state.config.request_timeout_s)
    try:  # tokenizing and compiling a grammar stay off the event loop
        futures = await asyncio.to_thread(engine.submit_many, call.prompts, call.sampling, call.adapter,
                                          [pieces.feeder(i) for i in range(len(call.prompts))])
    except KevError as exc:  # refused as a whole (the engine closed meanwhile)
        raise engine_error(exc, None, call.fields) from None
    arrival.end()
    _refused(futures, call.fields)
    for i, future in enumerate(futures):
        pieces.watch(i, future)
    n = call.sampling.n  # choice index of prompt i's sample j: i * n + j
    prompt_tokens = None  # each prompt's tokens, for usage on every chunk (the engine took them: they encode)
    if call.continuous_usage:
        try:
            prompt_tokens = await asyncio.to_thread(lambda: [len(engine.encode(p)) for p in call.prompts])
        except BaseException:
            for future in futures:
                future.cancel()
            raise

    async def stream() -> AsyncIterator[str]:
        writer = ChunkWriter(chat, call.model, n, prompt_tokens, call.show_logprobs)
        opened = [False] * (len(futures) * n)
        finished: list[Completion] = []
        try:
            remaining = len(futures)
            while remaining:
                try:
                    i, piece = await pieces.next()
                except asyncio.TimeoutError:
                    yield sse(APIError(504, "the request did not finish in time and was cancelled",
                                        type="timeout_error").body())
                    yield sse("[DONE]")  # the stream ends here on purpose: not a cut connection
                    return
                if isinstance(piece, str):
                    if not call.tool_names:  # tool-call markup is parsed at the end, not streamed
                        index = i * n + getattr(piece, "sample_index", 0)
                        yield sse(writer.text(index, piece, first=not opened[index],
                                              logprobs=getattr(piece, "logprobs", None)))
                        opened[index] = True
                    continue
                remaining -= 1
                future = piece
                if future.cancelled():
                    continue
                error = future.exception()
                if error is not None:
                    yield sse(engine_error(error, i if len(futures) > 1 else None, call.fields).body())
                    continue
                completion = future.result()
                finished.append(completion)
                for j, choice in enumerate(completion.samples or (completion,)):
                    cut = cut_forced_call(choice.text, call.tool_names, choice.finish_reason, call.forced_tool,
                                          call.sampling.max_tokens, f" (choice {i * n + j})" if n > 1 else "")
                    yield sse(cut.body() if cut is not None else writer.finish(i * n + j, choice, call.tool_names))
            if call.include_usage:
                yield sse(writer.usage(finished))
            yield sse("[DONE]")
            state.metrics.observe(call.endpoint, 200, time.perf_counter() - started)
        finally:  # the client left, or we are done: nothing keeps computing for nobody
            for future in futures:
                future.cancel()
            state.release(len(futures) * n)

    return stream()


def build_app(engine: Engine | Callable[[], Engine], config: ServerConfig | None = None,
              model_name: str | None = None, adapter_names: Callable[[], list[str]] | None = None) -> FastAPI:
    """The app over a ready engine, or over a factory called in a thread at start-up.

    `adapter_names` lists the adapters clients may name when the engine loads them on demand
    (a Ray replica loads one just before the request that names it); by default the engine's own.
    """
    config = config or ServerConfig()
    name = model_name or (engine.name if isinstance(engine, Engine) else "kev")
    state = ServerState(config, name, adapter_names)
    if isinstance(engine, Engine):  # ready now: also when the app is called without a lifespan (in a Ray replica)
        state.engine = engine

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not isinstance(engine, Engine):
            threading.Thread(target=state.load, args=(engine,), name="kev-load", daemon=True).start()
        yield
        state.close()
        if state.engine is not None and not isinstance(engine, Engine):  # we built it, we close it
            await asyncio.to_thread(state.engine.close, SHUTDOWN_CLOSE_S)

    app = FastAPI(title="Kev", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kev = state
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    app.add_middleware(PerKeyLimit, tenants=state.tenants, counts=state.in_flight, limit=config.max_requests_per_key,
                       retry_after_s=config.retry_after_s)  # outside the body limit: a slow body counts against its key
    app.add_middleware(Endings, draining=lambda: state.draining)  # added last: the outermost, so it sees
    # how every request ended (and refuses new ones while the server drains)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        state.metrics.observe(_route(request), exc.status)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """An unknown path (404) or method (405) in OpenAI's shape too, not Starlette's ``{"detail"}``."""
        what = {404: "no such endpoint", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
        return await api_error(request, APIError(
            exc.status_code, f"{what}: {request.method} {request.url.path[:200]}; `kev serve --help` lists the "
            "endpoints", code="not_found" if exc.status_code == 404 else None, headers=dict(exc.headers or {})))

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:  # a load balancer takes this server out while its last requests finish
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        if state.engine is not None:
            return JSONResponse({"status": "ok"})
        if state.load_error is not None:
            return JSONResponse({"status": "error", "message": str(state.load_error)}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        check_metrics_key(request, config)
        stats = state.engine.stats() if state.engine is not None else None
        text = state.metrics.render(stats, compiling=state.compiles.in_flight()[0])
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    add_model_routes(app, state, check_key)

    async def run(request: Request, chat: bool) -> Response:
        endpoint = _route(request)
        tenant = state.tenant(request, "/v1")
        started = time.perf_counter()
        engine_now = state.ready()
        # this request is on its way: an idle engine's first pass waits for it until it is queued, so a
        # burst of requests shares one pass (`Engine.arriving`); ended on every path
        arrival = engine_now.arriving()
        try:
            return await answer(request, chat, endpoint, tenant, started, engine_now, arrival)
        finally:
            arrival.end()

    async def answer(request: Request, chat: bool, endpoint: str, tenant: Tenant, started: float,
                     engine_now: Engine, arrival: Arrival) -> Response:
        body = await _json_body(request)
        if chat:
            call = parse_chat(body, config, state.model_name, state.adapter_names(), engine_now.tokenizer)
        else:
            call = parse_completion(body, config, state.model_name, state.adapter_names())
            call.prompts = engine_prompts(engine_now, call.prompts)  # token ids: fed as sent, once checked
        call.endpoint = endpoint
        call.sampling = tenant.scoped(call.sampling)
        error = (await state.compiles.ensure(engine_now, tenant, [call.sampling]))[0]
        if error is not None:
            raise engine_error(error, None, call.fields)
        # each sample is a question in flight, and so is each prompt whose logprobs an echo computes
        places = len(call.prompts) * (call.sampling.n * call.generate + (call.prompt_logprobs is not None))
        state.acquire(places, "n" if call.sampling.n > 1 else "prompt")  # 429 now, not mid-stream
        if call.stream:
            try:
                events = await _events(state, call, chat, engine_now, started, arrival)
            except BaseException:
                state.release(places)
                raise
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            futures: list[Future[Any]] = []
            if call.generate:
                try:
                    futures = await asyncio.to_thread(engine_now.submit_many, call.prompts, call.sampling,
                                                      call.adapter)
                    arrival.end()
                except KevError as exc:
                    raise engine_error(exc, None, call.fields) from None
                _refused(futures, call.fields)
            if call.echo:  # beside the answers: the prompts' own pass (logprobs) or only their token counts
                # on a thread that ends: the logprobs' tensor work leaves no OpenMP team beside the engine's
                futures.append(on_passing_thread(functools.partial(
                    echoed_prompts, engine_now, call.prompts, call.adapter, call.prompt_logprobs, call.fields),
                    "kev-echo"))
            results = await _answers(request, futures, config.request_timeout_s, call.fields, len(call.prompts))
        finally:
            state.release(places)
        if results is None:  # the client is gone; nobody reads a response
            state.metrics.observe(endpoint, 499)
            return Response(status_code=499)
        if chat:
            for index, choice in enumerate(choices_of(results)):
                cut = cut_forced_call(choice.text, call.tool_names, choice.finish_reason, call.forced_tool,
                                      call.sampling.max_tokens, f" (choice {index})" if call.sampling.n > 1 else "")
                if cut is not None:
                    raise cut
            state.metrics.observe(endpoint, 200, time.perf_counter() - started)
            return JSONResponse(chat_response(results[0], call.model, call.tool_names))
        state.metrics.observe(endpoint, 200, time.perf_counter() - started)
        echoed = results.pop() if call.echo else None
        if not call.generate:
            assert echoed is not None  # max_tokens 0 is refused without echo
            results = unanswered(echoed, call.sampling.n, call.prompt_logprobs is not None)
        return JSONResponse(completion_response(results, call.model, echoed))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    add_native_routes(app, state, lambda request: state.tenant(request, "/kev/v1"), _json_body)

    add_admin_routes(app, state, check_key, _json_body)

    return app
