"""What an operator decides about a server: who may call it and how much one caller may ask.

Defaults are safe to expose on loopback and refuse to be exposed beyond it without a key
(`check_exposure`). Keys compare in constant time; several API keys may be given.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

API_KEY_ENV = "KEV_API_KEY"  # comma-separated: several clients, several keys
ADMIN_KEY_ENV = "KEV_ADMIN_KEY"
METRICS_KEY_ENV = "KEV_METRICS_KEY"
# the cores left to the engine matter more than compile throughput: half of them at most
DEFAULT_COMPILE_WORKERS = max(1, min(4, (os.cpu_count() or 2) // 2))


POSITIVE_LIMITS = {"max_requests_per_key", "max_connections", "header_timeout_s", "body_timeout_s",
                   "max_tokenize_bytes", "tokenize_workers", "max_pending_tokenize", "compile_workers",
                   "max_compiles_per_key", "max_pending_compiles", "compile_timeout_s"}


@dataclass(frozen=True)
class ServerConfig:
    """Limits and keys of one `kev serve`."""

    api_keys: tuple[str, ...] = ()
    """Bearer keys accepted on /v1 (and /metrics where there is one: see `metrics_key`); empty = no
    auth (loopback only, see check_exposure)."""
    admin_key: str | None = None
    """Bearer key of the admin endpoints (adapters, default temperature); None = they are disabled."""
    metrics_key: str | None = None
    """Bearer key of /metrics for operators. /metrics shows the whole engine's activity (tokens,
    prefix hits, queue), so with several API keys a tenant's key is refused there (it would see the
    others'); this key or the admin key reads it. With one API key, that key reads it too."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body accepted (413 past it)."""
    max_prompts: int = 64
    """Most prompts in one /v1/completions request."""
    max_tokens_limit: int = 4096
    """Largest max_tokens a request may ask for."""
    max_queued: int = 256
    """Most questions accepted and not yet answered; past it a 429 with Retry-After."""
    request_timeout_s: float = 600.0
    """A request still unanswered after this long is cancelled (504)."""
    retry_after_s: int = 1
    """What a 429 tells the client to wait."""
    adapter_drain_wait_s: float = 30.0
    """How long loading an adapter whose name is still draining waits for it before a 409."""

    # ---- tenants: one per API key ----
    shared_prefix_cache: bool = False
    """Every API key shares one prefix cache. Off by default: a shared cache tells one tenant,
    through `cached_tokens` and answer times, what another sent (CVE-2025-46570). Without API
    keys every caller is one tenant anyway."""
    max_requests_per_key: int = 128
    """Most requests one API key has in flight (body arriving, queued, running, streaming); past
    it a 429. Without API keys this bounds all callers together."""

    # ---- what one request may hold ----
    max_connections: int = 1024
    """Most connections open at once (idle keep-alive ones included); past it a 503 with Retry-After."""
    header_timeout_s: float = 15.0
    """A connection whose request headers are not complete this long after it opened (or after its
    last response) is closed with a 408: slow senders cannot hold connections."""
    body_timeout_s: float = 60.0
    """A request body not fully received this long after its headers gets a 408."""
    max_tokenize_bytes: int = 1024 * 1024
    """Largest /kev/v1/tokenize body (413 past it): a MiB of text takes about half a second to tokenize."""
    tokenize_workers: int = 2
    """Threads that run /kev/v1/tokenize (off the event loop)."""
    max_pending_tokenize: int = 8
    """Tokenize requests running or waiting for those threads; past it a 429."""
    compile_workers: int = DEFAULT_COMPILE_WORKERS
    """Threads that compile grammars (JSON schemas, regexes, tool calls...), apart from everything else."""
    max_compiles_per_key: int = 1
    """Distinct grammars one API key may have compiling at once; past it a 429 (without API keys:
    all callers together)."""
    max_pending_compiles: int = 16
    """Distinct grammars compiling or waiting for a compile thread, all keys together; past it a 429."""
    compile_timeout_s: float = 10.0
    """Time budget of one compile: a 429 if no compile thread takes it up within this long, a 400 if
    it does not finish within this long once started."""

    def __post_init__(self) -> None:
        """An empty key would let anyone in (``--api-key "$UNSET_VAR"``): refuse it by name."""
        if any(not isinstance(k, str) or not k.strip() for k in self.api_keys):
            raise SystemExit("an API key is empty; give a non-empty --api-key (or KEV_API_KEY), or none at all")
        if self.admin_key is not None and not self.admin_key.strip():
            raise SystemExit("the admin key is empty; give a non-empty --admin-key (or KEV_ADMIN_KEY), or none")
        if self.metrics_key is not None and not self.metrics_key.strip():
            raise SystemExit("the metrics key is empty; give a non-empty --metrics-key (or KEV_METRICS_KEY), or none")
        for name in sorted(POSITIVE_LIMITS):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r} is not allowed; give a number > 0")

    @classmethod
    def from_env(cls, **overrides: object) -> ServerConfig:
        """Keys from ``KEV_API_KEY`` / ``KEV_ADMIN_KEY`` / ``KEV_METRICS_KEY`` unless given; other fields as passed."""
        if overrides.get("api_keys") is None:
            raw = os.environ.get(API_KEY_ENV, "")
            overrides["api_keys"] = tuple(k.strip() for k in raw.split(",") if k.strip())
        if overrides.get("admin_key") is None:
            overrides["admin_key"] = os.environ.get(ADMIN_KEY_ENV) or None
        if overrides.get("metrics_key") is None:
            overrides["metrics_key"] = os.environ.get(METRICS_KEY_ENV) or None
        return cls(**overrides)  # type: ignore[arg-type]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, config: ServerConfig, allow_no_auth: bool = False) -> None:
    """Refuse to serve beyond loopback without an API key: anyone on the network could use it."""
    if not is_loopback(host) and not config.api_keys and not allow_no_auth:
        raise SystemExit(
            f"refusing to listen on {host} without an API key: anyone who can reach it could use the model. "
            f"Pass --api-key (or set {API_KEY_ENV}), or --insecure-no-auth if this network is trusted"
        )
