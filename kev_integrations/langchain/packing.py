"""How a LangChain batch becomes ONE packed engine call, whatever each input's settings.

LangChain runs chat batches (and `configurable_fields` batches with differing settings) as one
`invoke` per input. Kev first builds every input's engine request and answers them all with one
`Engine.generate` call (one pack per `max_concurrency` inputs), then runs the ordinary `invoke`s
inside `prepared(...)`: their `_generate` finds its answer already computed and returns it, so
callbacks, tracing, caching and output parsing behave exactly as for a single call.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from kev_engine import Completion, Engine, SamplingParams

from ..streaming import astream_answer, stream_answer

Key = tuple[int, str, SamplingParams, str | None]
_PREPARED: ContextVar[dict[Key, deque[Completion | BaseException]] | None] = ContextVar("kev_prepared", default=None)


@dataclass(frozen=True)
class EngineRequest:
    """One question exactly as the engine will see it."""

    engine: Engine
    prompt: Any  # str | list[message dict] | {"messages": [...], "tools": [...]}
    sampling: SamplingParams
    adapter: str | None

    @property
    def key(self) -> Key:
        return (id(self.engine), json.dumps(self.prompt, sort_keys=True, default=str), self.sampling, self.adapter)


def answer_together(
    requests: Sequence[EngineRequest], max_concurrency: int | None = None
) -> list[Completion | BaseException]:
    """Answer all requests, one `generate` call (one pack) per engine and per `max_concurrency` slice."""
    results: list[Completion | BaseException | None] = [None] * len(requests)
    by_engine: dict[int, list[int]] = defaultdict(list)
    for i, request in enumerate(requests):
        by_engine[id(request.engine)].append(i)
    for indices in by_engine.values():
        size = max_concurrency or len(indices)
        for start in range(0, len(indices), size):
            chunk = [requests[i] for i in indices[start : start + size]]
            answers = chunk[0].engine.generate(
                [r.prompt for r in chunk], [r.sampling for r in chunk],
                return_exceptions=True, adapters=[r.adapter for r in chunk],
            )
            for i, answer in zip(indices[start : start + size], answers):
                results[i] = answer
    return results  # type: ignore[return-value]


@contextmanager
def prepared(requests: Sequence[EngineRequest], answers: Sequence[Completion | BaseException]) -> Iterator[None]:
    """Make `answers` available to the `_generate` calls run inside this block."""
    table: dict[Key, deque[Completion | BaseException]] = defaultdict(deque)
    for request, answer in zip(requests, answers):
        table[request.key].append(answer)
    token = _PREPARED.set(table)
    try:
        yield
    finally:
        _PREPARED.reset(token)


def take_prepared(request: EngineRequest) -> Completion | None:
    """The answer computed for this request by an enclosing batch, if any (raises its error)."""
    table = _PREPARED.get()
    if not table or not table.get(request.key):
        return None
    answer = table[request.key].popleft()
    if isinstance(answer, BaseException):
        raise answer
    return answer


def complete(request: EngineRequest, timeout: float | None = None) -> Completion:
    """One answer: prepared by a batch, else submitted (concurrent callers still share passes)."""
    answer = take_prepared(request)
    if answer is not None:
        return answer
    future = request.engine.submit(request.prompt, request.sampling, request.adapter)
    try:
        return future.result(timeout=timeout)
    finally:
        future.cancel()  # timed out or interrupted: stop computing (no-op once finished)


async def acomplete(request: EngineRequest, timeout: float | None = None) -> Completion:
    """Truly async: awaits the engine's future; cancelling the task cancels the request."""
    answer = take_prepared(request)
    if answer is not None:
        return answer
    future = request.engine.submit(request.prompt, request.sampling, request.adapter)
    return await asyncio.wait_for(asyncio.wrap_future(future), timeout)


def stream(request: EngineRequest) -> Iterator[str | Completion]:
    """Text pieces, then the `Completion`: prepared by a batch, else streamed by the engine."""
    answer = take_prepared(request)
    if answer is None:
        yield from stream_answer(request.engine, request.prompt, request.sampling, request.adapter)
        return
    if answer.text:
        yield answer.text
    yield answer


async def astream(request: EngineRequest) -> AsyncIterator[str | Completion]:
    """Async `stream`."""
    answer = take_prepared(request)
    if answer is None:
        async for item in astream_answer(request.engine, request.prompt, request.sampling, request.adapter):
            yield item
        return
    if answer.text:
        yield answer.text
    yield answer


class PackingModel(Protocol):
    """What `batch_packed` needs from a Kev LangChain model."""

    def engine_request(self, input: Any, kwargs: dict[str, Any]) -> EngineRequest: ...
    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any: ...
    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any: ...


def _requests(models: Sequence[PackingModel], inputs: Sequence[Any], kwargs: dict[str, Any]) -> list[EngineRequest]:
    requests = []
    for model, input_ in zip(models, inputs):
        try:
            requests.append(model.engine_request(input_, dict(kwargs)))
        except Exception:  # noqa: BLE001 - this input's own invoke raises it again, in its place
            continue
    return requests


def batch_packed(
    models: Sequence[PackingModel], inputs: Sequence[Any], configs: Sequence[Any], return_exceptions: bool,
    kwargs: dict[str, Any],
) -> list[Any]:
    """`Runnable.batch` for Kev models: one packed pass per `max_concurrency` inputs, then the invokes."""
    requests = _requests(models, inputs, kwargs)
    answers = answer_together(requests, configs[0].get("max_concurrency") if configs else None)
    results: list[Any] = []
    with prepared(requests, answers):
        for model, input_, config in zip(models, inputs, configs):
            try:
                results.append(model.invoke(input_, config, **kwargs))
            except Exception as exc:
                if not return_exceptions:
                    raise
                results.append(exc)
    return results


async def abatch_packed(
    models: Sequence[PackingModel], inputs: Sequence[Any], configs: Sequence[Any], return_exceptions: bool,
    kwargs: dict[str, Any],
) -> list[Any]:
    """Async `batch_packed`: the packed call runs in a worker thread, the event loop stays free."""
    requests = _requests(models, inputs, kwargs)
    max_concurrency = configs[0].get("max_concurrency") if configs else None
    answers = await asyncio.get_running_loop().run_in_executor(None, answer_together, requests, max_concurrency)
    results: list[Any] = []
    with prepared(requests, answers):
        for model, input_, config in zip(models, inputs, configs):
            try:
                results.append(await model.ainvoke(input_, config, **kwargs))
            except Exception as exc:
                if not return_exceptions:
                    raise
                results.append(exc)
    return results
