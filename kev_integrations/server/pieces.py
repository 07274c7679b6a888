"""The hand-off from the engine's delivery threads to the event loop, for streamed responses.

Both streaming endpoints (OpenAI's and Kev's own) need the same thing: each prompt's text
pieces, then its finished future, delivered on the event loop in the order the engine produced
them, with one deadline for the whole request. `on_text` callbacks and future callbacks run on
the engine's delivery threads, so everything crosses with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class Pieces:
    """What the streams of one request produced so far: ``(index, text piece | finished future)``."""

    def __init__(self, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, str | Future[Any]]] = asyncio.Queue()
        self._deadline = self._loop.time() + timeout

    def feeder(self, index: int) -> Callable[[str], None]:
        """An `on_text` for prompt `index` (called on an engine delivery thread)."""
        def feed(piece: str) -> None:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, piece))
        return feed

    def watch(self, index: int, future: Future[Any]) -> None:
        """Deliver `future` once it is done (after every piece it streamed)."""
        future.add_done_callback(lambda done: self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, done)))

    async def next(self) -> tuple[int, str | Future[Any]]:
        """The next piece or finished future; `TimeoutError` once the request's deadline passes."""
        return await asyncio.wait_for(self._queue.get(), timeout=max(0.0, self._deadline - self._loop.time()))
