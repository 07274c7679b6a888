"""Kev's own endpoints beside the OpenAI ones, for Kev's integrations used as clients.

`ChatKev(base_url=...)`, `KevLLM(base_url=...)` and LlamaIndex `Kev(base_url=...)` build the
same engine prompts and `SamplingParams` as they do locally (tool prompts, constraints, chat
templates) and send them here through `RemoteEngine`, so a LangChain `batch()` is still ONE
request and one pack on the server, and every per-call setting survives the trip.

- ``GET /kev/v1/info``: the model's name, context, adapters and chat template.
- ``POST /kev/v1/tokenize``: the ids of a prompt (chat template applied) or of a bare text,
  tokenized on a few threads of its own (never the event loop), bodies of at most
  `max_tokenize_bytes`, `max_pending_tokenize` at once (then a 429).
- ``POST /kev/v1/generate``: ``{"requests": [{"prompt", "sampling", "adapter", "stream"}]}`` →
  server-sent events ``{"index", "text"}`` (streamed requests; with ``"sample"`` when n > 1 and
  ``"logprobs"`` when asked for, as `TextPiece` carries them), then ``{"index", "completion"}``
  or ``{"index", "error": {"type", "message"}}`` per request, then ``[DONE]``. A bad request
  fails alone, as in `Engine.generate(..., return_exceptions=True)`; closing the stream
  cancels whatever is still running.

Each request's `cache_salt` is moved into its caller's tenant namespace, and constraints are
compiled in the server's compile pool first, as on the OpenAI endpoints (see `app`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kev_engine import (
    MAX_N,
    Completion,
    Engine,
    InvalidRequestError,
    KevError,
    SamplingParams,
    coerce_sampling,
    prompt_ids,
)

from .errors import APIError, bad_request, engine_error
from .pieces import Pieces
from .responses import sse
from .state import ServerState
from .tenants import Tenant


def error_body(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


def _sampling(raw: Any, limit: int) -> SamplingParams:
    sampling = coerce_sampling(raw)  # a dict of settings, or None; anything else is an InvalidRequestError
    if sampling.max_tokens > limit:
        raise InvalidRequestError(f"max_tokens={sampling.max_tokens} is over this server's limit of {limit}")
    return sampling


def _text_event(index: int, piece: str) -> dict[str, Any]:
    """A streamed piece as an event: its text, and the sample and logprobs a `TextPiece` carries."""
    event: dict[str, Any] = {"index": index, "text": str(piece)}
    if getattr(piece, "sample_index", 0):
        event["sample"] = piece.sample_index  # type: ignore[attr-defined]
    logprobs = getattr(piece, "logprobs", None)
    if logprobs is not None:
        event["logprobs"] = [dataclasses.asdict(entry) for entry in logprobs]
    return event


def _requests(body: dict[str, Any], state: ServerState) -> list[dict[str, Any]]:
    requests = body.get("requests")
    if set(body) != {"requests"} or not isinstance(requests, list) or not requests:
        raise bad_request("give {'requests': [{'prompt', 'sampling'?, 'adapter'?, 'stream'?}, ...]}", param="requests")
    if len(requests) > state.config.max_prompts:
        raise bad_request(f"{len(requests)} requests in one call; this server takes at most {state.config.max_prompts}",
                          param="requests")
    for i, request in enumerate(requests):
        if not isinstance(request, dict) or "prompt" not in request or set(request) - {
                "prompt", "sampling", "adapter", "stream"}:
            raise bad_request(f"requests[{i}] must be {{'prompt', 'sampling'?, 'adapter'?, 'stream'?}}",
                              param=f"requests[{i}]")
    return requests


def _places(requests: list[dict[str, Any]]) -> int:
    """Queue places the requests take: one per sample (``n``). A malformed ``n`` counts once; its
    request is refused by the engine's own check."""
    total = 0
    for request in requests:
        sampling = request.get("sampling")
        n = sampling.get("n", 1) if isinstance(sampling, dict) else 1
        total += n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1
    return total


async def _generate_events(state: ServerState, engine: Engine, tenant: Tenant,
                           requests: list[dict[str, Any]]) -> AsyncIterator[str]:
    pieces = Pieces(state.config.request_timeout_s)
    samplings: list[Any] = []
    for request in requests:
        try:
            samplings.append(tenant.scoped(_sampling(request.get("sampling"), state.config.max_tokens_limit)))
        except InvalidRequestError as exc:
            samplings.append(exc)
    for i, error in enumerate(await state.compiles.ensure(engine, tenant, samplings)):
        if error is not None:  # a constraint that does not compile (in time) fails its request alone
            samplings[i] = error
    valid = [i for i, s in enumerate(samplings) if not isinstance(s, BaseException)]
    try:
        submitted = await asyncio.to_thread(
            engine.submit_many, [requests[i]["prompt"] for i in valid], [samplings[i] for i in valid],
            [requests[i].get("adapter") for i in valid],
            [pieces.feeder(i) if requests[i].get("stream") else None for i in valid],
        ) if valid else []
    except KevError as exc:  # refused as a whole: the prompt list itself (or a closed engine)
        raise engine_error(exc, None) from None
    futures = dict(zip(valid, submitted))
    for i, sampling in enumerate(samplings):
        if isinstance(sampling, BaseException):  # a refused setting: a request that has already failed
            futures[i] = refused = Future()
            refused.set_exception(sampling)
        pieces.watch(i, futures[i])

    async def stream() -> AsyncIterator[str]:
        remaining = len(requests)
        try:
            while remaining:
                try:
                    i, piece = await pieces.next()
                except asyncio.TimeoutError:
                    for i in range(len(requests)):
                        yield sse({"index": i, "error": {"type": "TimeoutError", "message": "timed out"}})
                    yield sse("[DONE]")  # the stream ends here on purpose: not a cut connection
                    return
                if isinstance(piece, str):
                    yield sse(_text_event(i, piece))
                    continue
                remaining -= 1
                yield sse({"index": i, **_outcome(piece)})
            yield sse("[DONE]")
        finally:  # the client left or we are done: nothing keeps computing for nobody
            for future in futures.values():
                future.cancel()
            state.release(_places(requests))

    return stream()


def _outcome(future: Future[Completion]) -> dict[str, Any]:
    """A finished request's event body: its completion, or its error."""
    if future.cancelled():
        return {"error": {"type": "CancelledError", "message": "cancelled"}}
    error = future.exception()
    if error is not None:
        return {"error": error_body(error)}
    return {"completion": dataclasses.asdict(future.result())}


def _tokenize(engine: Engine, body: dict[str, Any]) -> list[int]:
    """The ids a tokenize body asks for (on a tokenize thread: a long text takes a while)."""
    if set(body) == {"text"} and isinstance(body["text"], str):
        return list(engine.tokenizer(body["text"], add_special_tokens=False)["input_ids"])
    if set(body) != {"prompt"}:
        raise bad_request("give {'prompt': <string or chat messages>} or {'text': <string>}")
    try:
        return prompt_ids(engine.tokenizer, body["prompt"])[1]
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param="prompt") from None


def add_native_routes(app: FastAPI, state: ServerState, tenant_of: Callable[[Request], Tenant],
                      json_body: Callable[[Request], Any]) -> None:
    """Kev's own endpoints; `tenant_of` authenticates a request (401) and names its tenant."""
    @app.get("/kev/v1/info")
    async def info(request: Request) -> JSONResponse:
        tenant_of(request)
        engine = state.ready()
        template = getattr(engine.tokenizer, "chat_template", None)
        return JSONResponse({"name": state.model_name, "max_context": engine.max_context,
                             "max_prompts": state.config.max_prompts,
                             "adapters": state.adapter_names(), "chat_template": template if isinstance(template, str)
                             else None})

    @app.post("/kev/v1/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        tenant_of(request)
        engine = state.ready()
        limit = state.config.max_tokenize_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:  # refused before reading (or parsing) it
            raise _tokenize_too_large(int(declared), limit)
        body = await json_body(request)
        size = len(await request.body())  # read once already: Starlette keeps it
        if size > limit:  # a chunked body declares no length
            raise _tokenize_too_large(size, limit)
        return JSONResponse({"ids": await state.tokenize.run(_tokenize, engine, body)})

    @app.post("/kev/v1/generate")
    async def generate(request: Request) -> StreamingResponse:
        tenant = tenant_of(request)
        engine = state.ready()
        requests = _requests(await json_body(request), state)
        state.acquire(_places(requests), "requests")
        try:
            events = await _generate_events(state, engine, tenant, requests)
        except BaseException:
            state.release(_places(requests))
            raise
        return StreamingResponse(events, media_type="text/event-stream")


def _tokenize_too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the tokenize body is {size} bytes; this server tokenizes at most {limit} bytes per request "
                    "(max_tokenize_bytes): split the text", code="body_too_large")
