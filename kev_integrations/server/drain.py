"""Shutdown that answers: on SIGTERM the socket stays open for the grace period.

uvicorn's own shutdown closes the listening socket at the first signal, so a client connecting
during the grace period is refused at the socket, which load balancers and OpenAI clients treat
as a network failure rather than "try elsewhere". Here the first SIGTERM/SIGINT only marks the
server as draining (`ServerState.draining`): new requests get `503 shutting_down` with
`Retry-After` (`endings.not_taken`), /health says "shutting_down", and requests in flight go on.
When none is left, or `grace` seconds have passed, uvicorn's shutdown runs with what is left of
the grace: still-running requests then get the 503 of `endings.shutting_down`. A second signal
stops at once, as uvicorn does.
"""

from __future__ import annotations

import time
from types import FrameType
from typing import Any

import uvicorn


class DrainingServer(uvicorn.Server):
    """A uvicorn server for an app of `build_app` (its `ServerState` is `state`)."""

    def __init__(self, config: uvicorn.Config, state: Any, grace: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace = grace
        self.draining_since: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining_since is None and self.grace > 0:
            self.draining_since = time.monotonic()
            self.state.draining = True
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.draining_since is not None and not self.should_exit:
            left = self.draining_since + self.grace - time.monotonic()
            if left <= 0 or not sum(self.state.in_flight.values()):
                # uvicorn's own drain gets the rest (it hands this to asyncio.timeout: seconds, a float)
                self.config.timeout_graceful_shutdown = max(left, 0.0)  # type: ignore[assignment]
                self.should_exit = True
        return await super().on_tick(counter)
