"""How a LangChain batch becomes ONE engine pass, whatever each input's settings.

LangChain runs chat batches (and `configurable_fields` batches with differing settings) as one
`invoke` per input. Kev runs those invokes side by side while their engines are held
(`Engine.hold()`: no pass starts), and lets the pass start once every invoke has either
submitted its requests or finished without any (an LLM-cache hit, a bad input). So:

- the requests still missing an answer share one pass (per `max_concurrency` inputs);
- each invoke is the ordinary one: callbacks, tracing, the LLM cache and output parsing behave
  as for a single call — `on_llm_start` fires before the pass, `on_llm_end` after its answer.

Why a hold and not `Engine.arriving()`, which lets a burst of callers share an idle engine's first
pass: an announcement is a clock's promise — it holds that pass only when the engine waits for
arrivals at all (``coalesce_ms`` > 0) and for a quarter of a second at most — and a `RemoteEngine`
has none. A batch knows its whole burst before it starts, which is what `hold()` is for: its pass
is one whatever the engine's ``coalesce_ms``, and on a `kev serve` the batch travels as one request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from concurrent import futures as cf
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar, copy_context
from typing import Any, Protocol

from kev_engine import EngineLike

# Bounds the wait for a batch's invokes to reach the engine. They only convert messages and run
# callbacks before submitting, so this is only reached when something blocks (a callback waiting
# on the held engine): the pass then starts anyway, with whoever has arrived.
GATHER_TIMEOUT_S = 30.0

_ARRIVED: ContextVar[Future[None] | None] = ContextVar("kev_batch_arrived", default=None)


def arrive() -> None:
    """Tell an enclosing batch that this invoke's requests are queued (a no-op outside a batch)."""
    arrived = _ARRIVED.get()
    if arrived is not None:
        with contextlib.suppress(cf.InvalidStateError):  # told already
            arrived.set_result(None)


class BatchModel(Protocol):
    """What a batch needs from a Kev LangChain model."""

    def get_engine(self) -> EngineLike: ...
    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any: ...
    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any: ...


@contextlib.contextmanager
def _held(models: Sequence[BatchModel]) -> Iterator[None]:
    """Hold every engine the models run on (each once)."""
    engines: dict[int, EngineLike] = {}
    for model in models:
        try:
            engine = model.get_engine()
        except Exception:  # noqa: BLE001 - that input's own invoke raises it again, in its place
            continue
        engines[id(engine)] = engine
    with contextlib.ExitStack() as stack:
        for engine in engines.values():
            stack.enter_context(engine.hold())
        yield


def _chunks(count: int, configs: Sequence[Any]) -> list[range]:
    size = (configs[0].get("max_concurrency") if configs else None) or count
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


def _invoke(arrived: Future[None], model: BatchModel, input_: Any, config: Any, kwargs: dict[str, Any]) -> Any:
    _ARRIVED.set(arrived)  # runs in its own copied context: visible to this invoke only
    try:
        return model.invoke(input_, config, **kwargs)
    finally:
        arrive()  # ended, with or without requests: nothing more of it to wait for


async def _ainvoke(arrived: Future[None], model: BatchModel, input_: Any, config: Any, kwargs: dict[str, Any]) -> Any:
    _ARRIVED.set(arrived)  # a task has its own context
    try:
        return await model.ainvoke(input_, config, **kwargs)
    finally:
        arrive()


def _start(pool: ThreadPoolExecutor, models: Sequence[BatchModel], inputs: Sequence[Any], configs: Sequence[Any],
           chunk: range, kwargs: dict[str, Any]) -> dict[Future[Any], int]:
    """The invokes of one chunk started side by side on `pool`, the engines held until each has
    submitted its requests (or finished without any); each future's input index."""
    arrivals: list[Future[None]] = [Future() for _ in chunk]
    with _held([models[i] for i in chunk]):
        started = {pool.submit(copy_context().run, _invoke, arrived, models[i], inputs[i], configs[i],
                               dict(kwargs)): i for arrived, i in zip(arrivals, chunk)}
        cf.wait(arrivals, GATHER_TIMEOUT_S)
    return started


def batch(
    models: Sequence[BatchModel], inputs: Sequence[Any], configs: Sequence[Any], return_exceptions: bool,
    kwargs: dict[str, Any],
) -> list[Any]:
    """`Runnable.batch` for Kev models: the invokes side by side, one pass per `max_concurrency` inputs."""
    results: list[Any] = []
    for chunk in _chunks(len(inputs), configs):
        with ThreadPoolExecutor(max_workers=max(1, len(chunk)), thread_name_prefix="kev-batch") as pool:
            for future in _start(pool, models, inputs, configs, chunk, kwargs):
                try:  # the invokes end with their answers; they bound their own waits
                    results.append(future.result())
                except Exception as exc:
                    if not return_exceptions:
                        raise
                    results.append(exc)
    return results


def batch_as_completed(
    models: Sequence[BatchModel], inputs: Sequence[Any], configs: Sequence[Any], return_exceptions: bool,
    kwargs: dict[str, Any],
) -> Iterator[tuple[int, Any]]:
    """`Runnable.batch_as_completed` for Kev models: one pass per chunk as `batch`, each (index,
    answer) yielded as soon as it is done."""
    for chunk in _chunks(len(inputs), configs):
        with ThreadPoolExecutor(max_workers=max(1, len(chunk)), thread_name_prefix="kev-batch") as pool:
            started = _start(pool, models, inputs, configs, chunk, kwargs)
            for future in cf.as_completed(started):
                try:
                    yield started[future], future.result()
                except Exception as exc:
                    if not return_exceptions:
                        raise
                    yield started[future], exc


async def abatch(
    models: Sequence[BatchModel], inputs: Sequence[Any], configs: Sequence[Any], return_exceptions: bool,
    kwargs: dict[str, Any],
) -> list[Any]:
    """Async `batch`: the invokes are tasks on the running loop."""
    results: list[Any] = []
    for chunk in _chunks(len(inputs), configs):
        arrivals: list[Future[None]] = [Future() for _ in chunk]
        with _held([models[i] for i in chunk]):
            tasks = [asyncio.create_task(_ainvoke(arrived, models[i], inputs[i], configs[i], dict(kwargs)))
                     for arrived, i in zip(arrivals, chunk)]
            await asyncio.wait([asyncio.wrap_future(arrived) for arrived in arrivals], timeout=GATHER_TIMEOUT_S)
        answers = await asyncio.gather(*tasks, return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not (return_exceptions and isinstance(answer, Exception)):
                raise answer
            results.append(answer)
    return results
