"""Start a Kev app under uvicorn on a loopback port for one test, and always shut it down."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `predicate` until it is truthy; fail naming `what` after `timeout` seconds (never forever)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def free_port() -> int:
    """A loopback port free right now, for servers that must be told their port (Ray Serve, subprocesses)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serving(app: Any, grace: float | None = None, port: int = 0, **options: Any) -> Iterator[str]:
    """Run `app` on 127.0.0.1 (`port`, 0: a free one) in a thread; yield its base URL; stop it on exit.

    `grace`: what `kev serve --grace` sets, the seconds running requests get once the stop begins
    (None: uvicorn waits for them). `options` go to `uvicorn.Config` (``http=`` a protocol class,
    as `kev serve` passes one).
    """
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=grace, **options))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, START_TIMEOUT_S, "uvicorn to start")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT_S)
        assert not thread.is_alive(), "uvicorn did not stop"
