"""Streaming for both front ends: text pieces as the engine makes them, then the `Completion`.

The engine calls `on_text` on one of its delivery threads; these generators hand the pieces to
the caller's thread (a queue) or event loop (`call_soon_threadsafe`), so a slow reader never
holds up even its own delivery. Stopping early cancels the request. A stream is one answer:
with n > 1 only the first sample's pieces are yielded (the final `Completion` holds all n).
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from kev_engine import Completion, EngineLike, SamplingParams

from .follow_ups import FollowUp, submit_options


def stream_answer(
    engine: EngineLike, prompt: object, sampling: SamplingParams, adapter: str | None,
    on_submitted: Callable[[], None] | None = None, tool_names: Sequence[str] = (), follow_up: bool = False,
) -> Iterator[str | Completion]:
    """Text pieces, then the final `Completion` (for usage and finish reason).

    `on_submitted()` runs once the request is queued (a LangChain batch waits for that). With
    `tool_names` offered, an answer that calls one expects its caller back; `follow_up`: this
    question continues after a tool result (`follow_ups`).
    """
    pieces: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def put(piece: str) -> None:
        if not getattr(piece, "sample_index", 0):
            pieces.put(piece)

    future = engine.submit(prompt, sampling, adapter, on_text=put,  # type: ignore[arg-type]
                           **submit_options(follow_up))
    future.add_done_callback(lambda _: pieces.put(None))
    expected = FollowUp(engine, future, tool_names)
    if on_submitted is not None:
        on_submitted()
    try:
        while (piece := pieces.get()) is not None:
            yield piece
        yield expected.answered(future.result())  # a failed request raises here, after what it streamed
    finally:
        expected.abandon()  # left early: nobody comes back (a no-op once answered)
        future.cancel()  # the consumer stopped early: stop computing (no-op once finished)


async def astream_answer(
    engine: EngineLike, prompt: object, sampling: SamplingParams, adapter: str | None,
    on_submitted: Callable[[], None] | None = None, tool_names: Sequence[str] = (), follow_up: bool = False,
) -> AsyncIterator[str | Completion]:
    """`stream_answer` for an event loop: awaiting never blocks the loop."""
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[str | None] = asyncio.Queue()

    def put(piece: str | None) -> None:  # runs on a delivery thread: must never raise there
        if getattr(piece, "sample_index", 0):
            return
        try:
            loop.call_soon_threadsafe(pieces.put_nowait, piece)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            future.cancel()

    future = engine.submit(prompt, sampling, adapter, on_text=put,  # type: ignore[arg-type]
                           **submit_options(follow_up))
    future.add_done_callback(lambda _: put(None))
    expected = FollowUp(engine, future, tool_names)
    if on_submitted is not None:
        on_submitted()
    try:
        while (piece := await pieces.get()) is not None:
            yield piece
        completion: Completion = await asyncio.wrap_future(future)
        yield expected.answered(completion)
    finally:
        expected.abandon()
        future.cancel()
