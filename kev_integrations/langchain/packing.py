"""How a LangChain batch becomes ONE packed engine pass, whatever each input's settings.

LangChain runs chat batches (and `configurable_fields` batches with differing settings) as one
`invoke` per input. Kev runs those invokes side by side while their engines are held
(`Engine.hold()`: no pass starts), and lets the pass start once every invoke has either
submitted its request or finished without one (an LLM-cache hit, a bad input). So:

- the requests still missing an answer share one packed pass (per `max_concurrency` inputs);
- each invoke is the ordinary one: callbacks, tracing, the LLM cache and output parsing behave
  as for a single call — `on_llm_start` fires before the pass, `on_llm_end` after its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent import futures as cf
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar, copy_context
from dataclasses import dataclass
from typing import Any, Protocol

from kev_engine import Completion, EngineLike, SamplingParams

from ..follow_ups import FollowUp, submit_options
from ..streaming import astream_answer, stream_answer

# Bounds the wait for a batch's invokes to reach the engine. They only convert messages and run
# callbacks before submitting, so this is only reached when something blocks (a callback waiting
# on the held engine): the pass then starts anyway, with whoever has arrived.
GATHER_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class EngineRequest:
    """One question exactly as the engine will see it."""

    engine: EngineLike
    prompt: Any  # str | list[message dict] | {"messages": [...], "tools": [...]}
    sampling: SamplingParams
    adapter: str | None
    follow_up: bool = False  # it continues after a tool result (an agent's next question, `follow_ups`)


class _Gate:
    """Counts the invokes of one pack until each has submitted its request or finished."""

    def __init__(self, count: int, on_all_arrived: Callable[[], object]) -> None:
        self._lock = threading.Lock()
        self._left = count
        self._on_all_arrived = on_all_arrived
        if count == 0:
            on_all_arrived()

    def arrive(self) -> None:
        with self._lock:
            self._left -= 1
            done = self._left == 0
        if done:
            self._on_all_arrived()


class _Arrival:
    """One invoke's single arrival at its gate (later calls are no-ops)."""

    def __init__(self, gate: _Gate) -> None:
        self._gate: _Gate | None = gate

    def __call__(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.arrive()


# what a timed-out wait raises: one class since Python 3.11, three before
TIMEOUTS = (TimeoutError, cf.TimeoutError, asyncio.TimeoutError)

_ARRIVAL: ContextVar[_Arrival | None] = ContextVar("kev_arrival", default=None)


def arrive() -> None:
    """Tell an enclosing batch that this invoke's requests are queued (no-op outside a batch)."""
    arrival = _ARRIVAL.get()
    if arrival is not None:
        arrival()


def timeout_error(timeout: float | None) -> TimeoutError:
    return TimeoutError(f"no answer within timeout={timeout} s; the request was cancelled")


def submit_all(requests: Sequence[EngineRequest]) -> list[Future[Completion]]:
    """Queue the requests together (they share the next pass); an enclosing batch is told."""
    with contextlib.ExitStack() as stack:
        for engine in {id(r.engine): r.engine for r in requests}.values():
            stack.enter_context(engine.hold())
        futures = [r.engine.submit(r.prompt, r.sampling, r.adapter, **submit_options(r.follow_up))
                   for r in requests]
    arrive()
    return futures


def wait(futures: Sequence[Future[Completion]], timeout: float | None) -> list[Completion]:
    """All answers, within `timeout` seconds in all; on a timeout or error every request is cancelled."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        return [f.result(None if deadline is None else max(0.0, deadline - time.monotonic())) for f in futures]
    except TIMEOUTS:
        raise timeout_error(timeout) from None
    finally:
        for future in futures:
            future.cancel()  # timed out, failed or interrupted: stop computing (no-op once finished)


async def await_all(futures: Sequence[Future[Completion]], timeout: float | None) -> list[Completion]:
    """Async `wait`: awaiting never blocks the loop; cancelling the task cancels the requests."""
    try:
        return list(await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), timeout))
    except TIMEOUTS:
        raise timeout_error(timeout) from None
    finally:
        for future in futures:
            future.cancel()


def complete(request: EngineRequest, timeout: float | None = None, tool_names: Sequence[str] = ()) -> Completion:
    """One answer; inside a batch, it joins the batch's pass. With `tool_names` offered, an
    answer that calls one expects its caller back (`follow_ups`)."""
    futures = submit_all([request])
    follow_up = FollowUp(request.engine, futures[0], tool_names)
    try:
        return follow_up.answered(wait(futures, timeout)[0])
    except BaseException:
        follow_up.abandon()
        raise


async def acomplete(request: EngineRequest, timeout: float | None = None, tool_names: Sequence[str] = ()) -> Completion:
    """Truly async `complete`."""
    futures = submit_all([request])
    follow_up = FollowUp(request.engine, futures[0], tool_names)
    try:
        return follow_up.answered((await await_all(futures, timeout))[0])
    except BaseException:
        follow_up.abandon()
        raise


def stream(request: EngineRequest, tool_names: Sequence[str] = ()) -> Iterator[str | Completion]:
    """Text pieces as the engine makes them, then the `Completion`."""
    return stream_answer(request.engine, request.prompt, request.sampling, request.adapter, on_submitted=arrive,
                         tool_names=tool_names, follow_up=request.follow_up)


def astream(request: EngineRequest, tool_names: Sequence[str] = ()) -> AsyncIterator[str | Completion]:
    """Async `stream`."""
    return astream_answer(request.engine, request.prompt, request.sampling, request.adapter, on_submitted=arrive,
                          tool_names=tool_names, follow_up=request.follow_up)


class PackingModel(Protocol):
    """What `batch_packed` needs from a Kev LangChain model."""

    def get_engine(self) -> EngineLike: ...
    def invoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any: ...
    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any: ...


@contextlib.contextmanager
def _held(models: Sequence[PackingModel]) -> Iterator[None]:
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


def _invoke(arrival: _Arrival, model: PackingModel, input_: Any, config: Any, kwargs: dict[str, Any]) -> Any:
    _ARRIVAL.set(arrival)  # runs in its own copied context: visible to this invoke only
    try:
        return model.invoke(input_, config, **kwargs)
    finally:
        arrival()


async def _ainvoke(arrival: _Arrival, model: PackingModel, input_: Any, config: Any, kwargs: dict[str, Any]) -> Any:
    _ARRIVAL.set(arrival)  # a task has its own context
    try:
        return await model.ainvoke(input_, config, **kwargs)
    finally:
        arrival()


def _start_pack(pool: ThreadPoolExecutor, models: Sequence[PackingModel], inputs: Sequence[Any],
                configs: Sequence[Any], chunk: range, kwargs: dict[str, Any]) -> dict[Future[Any], int]:
    """The invokes of one pack started side by side on `pool`, the engines held until each has
    submitted its request (or finished without one); each future's input index."""
    all_arrived = threading.Event()
    gate = _Gate(len(chunk), all_arrived.set)
    with _held([models[i] for i in chunk]):
        futures = {pool.submit(copy_context().run, _invoke, _Arrival(gate), models[i], inputs[i], configs[i],
                               dict(kwargs)): i for i in chunk}
        all_arrived.wait(GATHER_TIMEOUT_S)
    return futures


def batch_packed(
    models: Sequence[PackingModel], inputs: Sequence[Any], configs: Sequence[Any], return_exceptions: bool,
    kwargs: dict[str, Any],
) -> list[Any]:
    """`Runnable.batch` for Kev models: the invokes side by side, one packed pass per `max_concurrency` inputs."""
    results: list[Any] = []
    for chunk in _chunks(len(inputs), configs):
        with ThreadPoolExecutor(max_workers=max(1, len(chunk)), thread_name_prefix="kev-batch") as pool:
            for future in _start_pack(pool, models, inputs, configs, chunk, kwargs):
                try:  # the invokes end with their answers; they bound their own waits
                    results.append(future.result())
                except Exception as exc:
                    if not return_exceptions:
                        raise
                    results.append(exc)
    return results


def batch_as_completed_packed(
    models: Sequence[PackingModel], inputs: Sequence[Any], configs: Sequence[Any], return_exceptions: bool,
    kwargs: dict[str, Any],
) -> Iterator[tuple[int, Any]]:
    """`Runnable.batch_as_completed` for Kev models: packed as `batch_packed`, each (index, answer)
    yielded as soon as it is done."""
    for chunk in _chunks(len(inputs), configs):
        with ThreadPoolExecutor(max_workers=max(1, len(chunk)), thread_name_prefix="kev-batch") as pool:
            started = _start_pack(pool, models, inputs, configs, chunk, kwargs)
            for future in cf.as_completed(started):
                try:
                    yield started[future], future.result()
                except Exception as exc:
                    if not return_exceptions:
                        raise
                    yield started[future], exc


async def abatch_packed(
    models: Sequence[PackingModel], inputs: Sequence[Any], configs: Sequence[Any], return_exceptions: bool,
    kwargs: dict[str, Any],
) -> list[Any]:
    """Async `batch_packed`: the invokes are tasks on the running loop."""
    loop = asyncio.get_running_loop()
    results: list[Any] = []
    for chunk in _chunks(len(inputs), configs):
        all_arrived = asyncio.Event()
        gate = _Gate(len(chunk), functools.partial(loop.call_soon_threadsafe, all_arrived.set))
        with _held([models[i] for i in chunk]):
            tasks = [
                asyncio.create_task(_ainvoke(_Arrival(gate), models[i], inputs[i], configs[i], dict(kwargs)))
                for i in chunk
            ]
            with contextlib.suppress(*TIMEOUTS):
                await asyncio.wait_for(all_arrived.wait(), GATHER_TIMEOUT_S)
        answers = await asyncio.gather(*tasks, return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not (return_exceptions and isinstance(answer, Exception)):
                raise answer
            results.append(answer)
    return results
