"""What one `kev serve` holds while it runs: its engine (once loaded), its tenants, what it counts.

Shared by the app and its route modules (`admin`, `models`, `native`); it knows nothing of them.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from fastapi import Request

from kev_engine import Engine

from .compiles import Compiles
from .config import ServerConfig
from .errors import APIError, bad_request
from .metrics import Metrics
from .tenants import Tenant, Tenants, check_key
from .workers import Workers


class ServerState:
    """The engine (once loaded) and what the HTTP layer counts."""

    def __init__(self, config: ServerConfig, model_name: str,
                 adapter_names: Callable[[], list[str]] | None = None) -> None:
        self.config = config
        self.model_name = model_name
        self.engine: Engine | None = None
        self._adapter_names = adapter_names
        self.load_error: BaseException | None = None
        self.metrics = Metrics()
        self.tenants = Tenants(config.api_keys, shared_cache=config.shared_prefix_cache)
        self.in_flight: Counter[str] = Counter()  # requests in flight by tenant id (PerKeyLimit counts them)
        self.draining = False  # shutting down: new requests get 503 while those in flight finish (`drain`)
        self.compiles = Compiles(config)
        self.tokenize = Workers("tokenize", config.tokenize_workers, config.max_pending_tokenize,
                                config.retry_after_s)
        self._lock = threading.Lock()

    def load(self, factory: Callable[[], Engine]) -> None:
        try:
            self.engine = factory()
        except BaseException as exc:  # noqa: BLE001 - reported by /health and every request
            self.load_error = exc

    def ready(self) -> Engine:
        if self.engine is not None:
            return self.engine
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error}", type="server_error")
        raise APIError(503, "the model is still loading; retry shortly", type="server_error",
                       headers={"Retry-After": "5"})

    def adapter_names(self) -> list[str]:
        """The adapters clients may name: the engine's, or a catalog loaded on demand (Ray replicas)."""
        if self._adapter_names is not None:
            return self._adapter_names()
        return self.ready().adapters

    def acquire(self, count: int, param: str = "prompt") -> None:
        """Take `count` queue places for one request (one per prompt and sample), or refuse it
        with 429 (no unbounded queue); `param` names the field to blame when it can never fit."""
        if count > self.config.max_queued:  # would never fit: retrying cannot help
            raise bad_request(f"{count} questions (prompts x n samples) in one request; this server holds at most "
                              f"{self.config.max_queued} questions in flight", param=param)
        with self._lock:
            if self.metrics.queued + count > self.config.max_queued:
                raise APIError(429, f"the server has {self.metrics.queued} questions in flight (limit "
                               f"{self.config.max_queued}); retry later", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": str(self.config.retry_after_s)})
            self.metrics.queued += count

    def release(self, count: int) -> None:
        with self._lock:
            self.metrics.queued -= count

    def tenant(self, request: Request, what: str) -> Tenant:
        """The caller of `request` (a 401 without a valid key)."""
        return self.tenants.of(check_key(request, self.config.api_keys, what))

    def close(self) -> None:
        """Stop the server's own threads (what they were doing has no reader any more)."""
        self.compiles.close()
        self.tokenize.close()
