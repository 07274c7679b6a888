"""One LangChain call through the engine: its requests queued together, its answers awaited.

Where this sits: `ChatKev` and `KevLLM` turn a call into `EngineRequest`s and hand them here. The
requests of one call are submitted while their engines are held, so they share a pass; an
enclosing batch is told once they are queued (`coalesce.arrive`). Every wait is bounded by the
call's `timeout`, and a timeout, an error or an interrupt cancels every request of the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent import futures as cf
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kev_engine import Completion, EngineLike, SamplingParams

from ..follow_ups import FollowUp, submit_options
from ..streaming import astream_answer, stream_answer
from .coalesce import arrive

# what a timed-out wait raises: one class since Python 3.11, three before
TIMEOUTS = (TimeoutError, cf.TimeoutError, asyncio.TimeoutError)


@dataclass(frozen=True)
class EngineRequest:
    """One question exactly as the engine will see it."""

    engine: EngineLike
    prompt: Any  # str | list[message dict] | {"messages": [...], "tools": [...]}
    sampling: SamplingParams
    adapter: str | None
    follow_up: bool = False  # it continues after a tool result (an agent's next question, `follow_ups`)


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
