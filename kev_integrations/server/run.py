"""`kev serve`: load the model in the background, serve the OpenAI-compatible API with uvicorn.

The socket listens at once (/health says "loading" meanwhile); once the model and every
`--adapter` have loaded, a "ready" line with the URL goes to stderr. If either cannot load, the
reason goes to stderr and the process exits 2, as `kev generate` does — never a server that
answers 503 forever. SIGTERM / Ctrl-C: running requests (streams too) get up to `--grace`
seconds to finish while new ones are answered 503 `shutting_down` (`drain`: the socket stays
open), then what is still running gets a 503 (an error event on streams) and the app's shutdown
closes the engine. Nothing here binds beyond loopback without an API key.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kev_engine import EMBEDDED_NAME, Engine, cli

from .config import ServerConfig, check_exposure

ENDPOINTS = """endpoints:
  POST /v1/chat/completions, /v1/completions   OpenAI's API; `model` is the served name or an adapter's
  GET  /v1/models                               the base model and each adapter
  GET  /health                                  503 while loading, 200 when ready (no key)
  GET  /metrics                                 Prometheus text
  GET  /kev/v1/info, POST /kev/v1/tokenize, POST /kev/v1/generate
                                                Kev's own, for ChatKev/KevLLM/Kev(base_url=...)
  GET, POST /admin/adapters, DELETE /admin/adapters/NAME, POST /admin/defaults
                                                hot adapters and default temperature (--admin-key)
/v1, /kev/v1 and /metrics take the --api-key as 'Authorization: Bearer KEY' when one is set."""
LOAD_FAILED = 2  # the status `kev generate` exits with when the model or an adapter cannot load


class StartError(RuntimeError):
    """The model or an adapter given on the command line could not be loaded; says which."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Serve the OpenAI-compatible API over one engine (or Ray Serve replicas with --ray)."
    parser.epilog = ENDPOINTS
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the endpoint table's lines
    cli.add_model_arguments(parser)
    parser.add_argument("--served-model-name", dest="served_name", help="the `model` id clients send "
                        "(default: the --model value, or the embedded model's name)")
    parser.add_argument("--adapter", dest="adapter_specs", action="append", default=[], metavar="NAME=PATH",
                        help="load a PEFT LoRA folder as NAME, served as model id NAME (repeatable)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                        help="accept this bearer key on /v1, and on /metrics if it is the only one "
                        "(repeatable; default: $KEV_API_KEY)")
    parser.add_argument("--admin-key", dest="admin_key", help="bearer key of /admin (default: $KEV_ADMIN_KEY; "
                        "without one the admin endpoints are off)")
    parser.add_argument("--metrics-key", dest="metrics_key",
                        help="bearer key of /metrics for operators (default: $KEV_METRICS_KEY). With several "
                        "--api-key, tenant keys cannot read /metrics (it shows every tenant's activity): "
                        "this key or --admin-key can")
    parser.add_argument("--insecure-no-auth", dest="no_auth", action="store_true",
                        help="allow a non-loopback --host without an API key")
    parser.add_argument("--shared-prefix-cache", dest="shared_prefix_cache", action="store_true",
                        help="let all API keys share one prefix cache. RISK: a caller can then learn from "
                        "cached_tokens and answer times whether another sent a given prompt (CVE-2025-46570). "
                        "Default: each key is a tenant with its own cache namespace (without keys, all callers "
                        "are one tenant)")
    parser.add_argument("--max-requests-per-key", dest="max_requests_per_key", type=int, default=128,
                        help="requests one API key may have in flight before 429 (default 128)")
    parser.add_argument("--max-connections", dest="max_connections", type=int, default=1024,
                        help="connections open at once (idle keep-alive ones too) before 503 (default 1024)")
    parser.add_argument("--max-queued", dest="max_queued", type=int, default=256,
                        help="questions in flight before 429 (default 256)")
    parser.add_argument("--max-tokens-limit", dest="max_tokens_limit", type=int, default=4096,
                        help="largest max_tokens a request may ask (default 4096)")
    parser.add_argument("--max-prompts", dest="max_prompts", type=int, default=64,
                        help="most prompts in one /v1/completions request (default 64)")
    parser.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=600.0,
                        help="seconds before an unfinished request is cancelled (default 600)")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds running requests get to finish on SIGTERM (default 30)")
    ray = parser.add_argument_group("Ray (needs kev-llm[ray])")
    ray.add_argument("--ray", action="store_true", help="serve from Ray Serve replicas, routed by adapter")
    ray.add_argument("--replicas", type=int, default=1, help="engine replicas, one GPU each where the cluster has "
                     "GPUs (default 1)")
    ray.add_argument("--ray-address", dest="ray_address", help="cluster to join (default: $RAY_ADDRESS, else a "
                     "new local Ray)")
    ray.add_argument("--cpus-per-replica", dest="cpus_per_replica", type=float,
                     help="CPUs (and torch threads) per replica (default: one GPU each where the cluster has "
                     "GPUs, else its CPUs shared out)")
    ray.add_argument("--max-adapters-per-replica", dest="max_adapters", type=int, default=4,
                     help="adapters one replica holds at once, least recently used evicted (default 4)")


def parse_adapter_specs(specs: list[str]) -> dict[str, str]:
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--adapter {spec!r} is not NAME=PATH")
        adapters[name] = path
    return adapters


def missing_adapter_folder(adapters: dict[str, str]) -> str | None:
    """Why an `--adapter` cannot load before anything is loaded (its folder is missing), or None."""
    for name, path in adapters.items():
        if not Path(path).expanduser().is_dir():
            return f"--adapter {name}={path}: folder {path!r} does not exist"
    return None


def engine_factory(model: str | None, device: str | None, dtype: str | None,
                   adapters: dict[str, str], max_model_len: int | None = None,
                   model_impl: str | None = None, speculative: str | None = None,
                   weights: str | None = None, draft_model: str | None = None) -> Callable[[], Engine]:
    """The engine with its adapters, or a `StartError` naming the flag whose value did not load."""
    def load() -> Engine:
        try:
            engine = Engine.from_pretrained(model, device=device, dtype=dtype, max_model_len=max_model_len,
                                            model_impl=model_impl, speculative=speculative, weights=weights,
                                            draft_model=draft_model)
        except Exception as exc:
            raise StartError(f"--model {model or EMBEDDED_NAME!r} could not be loaded: "
                             f"{type(exc).__name__}: {exc}") from exc
        for name, path in adapters.items():
            try:
                engine.load_adapter(name, path)
            except Exception as exc:
                engine.close()  # nothing will serve it: its scheduler thread ends now
                raise StartError(f"--adapter {name}={path} could not be loaded: {type(exc).__name__}: {exc}") from exc
        return engine
    return load


class Ready:
    """Prints the "ready" line once both the model has loaded and the socket listens (either may
    finish last); a load that fails prints why and stops the server instead."""

    def __init__(self, served_name: str, stop: Callable[[], None]) -> None:
        self._served_name, self._stop = served_name, stop
        self._lock = threading.Lock()
        self._loaded = False
        self._how = ""  # the engine's dtype and batch invariance, once loaded
        self._url: str | None = None
        self.failure: BaseException | None = None

    def loader(self, factory: Callable[[], Engine]) -> Callable[[], Engine]:
        def load() -> Engine:
            try:
                engine = factory()
            except BaseException as exc:
                self.failure = exc
                print(f"kev: error: {exc}", file=sys.stderr, flush=True)
                self._stop()
                raise
            stats = engine.stats()
            with self._lock:
                self._loaded = True
                invariant = "batch-invariant" if stats["batch_invariant"] else "not batch-invariant"
                self._how = f" ({stats['dtype']}, {invariant})"
                self._say()
            return engine
        return load

    def listening(self, host: str, port: int) -> None:
        with self._lock:
            self._url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            self._say()

    def _say(self) -> None:
        if self._loaded and self._url is not None:
            print(f"kev: ready: {self._served_name}{self._how} at {self._url} (OpenAI API at {self._url}/v1; "
                  "`kev serve --help` lists the endpoints)", file=sys.stderr, flush=True)


def settings(args: Any) -> tuple[ServerConfig, dict[str, str], str]:
    """What `kev serve`'s arguments configure, checked before anything loads: the server's
    config (refused where it would expose an unauthenticated server), the adapters, the served name."""
    config = ServerConfig.from_env(
        api_keys=tuple(args.api_keys) if args.api_keys else None, admin_key=args.admin_key,
        metrics_key=args.metrics_key,
        max_queued=args.max_queued, max_tokens_limit=args.max_tokens_limit, max_prompts=args.max_prompts,
        request_timeout_s=args.request_timeout_s, shared_prefix_cache=args.shared_prefix_cache,
        max_requests_per_key=args.max_requests_per_key, max_connections=args.max_connections,
    )
    check_exposure(args.host, config, allow_no_auth=args.no_auth)
    adapters = parse_adapter_specs(args.adapter_specs)
    return config, adapters, args.served_name or args.model or EMBEDDED_NAME


def serve(args: Any, config: ServerConfig, adapters: dict[str, str], name: str) -> int:
    """Run the server in this process until SIGTERM / Ctrl-C; returns the exit status (`--ray`
    runs it on Ray Serve instead: `kev_integrations.ray.run`)."""
    try:
        import uvicorn

        from .app import build_app
        from .drain import DrainingServer
        from .header_deadline import header_deadline_protocol
    except ImportError as exc:
        raise SystemExit(f"kev serve needs the server extra: pip install 'kev-llm[server]' ({exc})") from None
    if args.replicas != 1:
        raise SystemExit(f"--replicas {args.replicas} needs --ray (one process serves one engine)")
    missing = missing_adapter_folder(adapters)  # found before the slow model load, as kev generate does
    if missing is not None:
        print(f"kev: error: {missing}", file=sys.stderr)
        return LOAD_FAILED

    class Server(DrainingServer):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.servers and self.servers[0].sockets:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                ready.listening(host, port)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            """SIGTERM/SIGINT start uvicorn's graceful drain; unlike uvicorn's own handler, the signal
            is not raised again afterwards, so a drained server exits 0 (not "killed by SIGTERM")."""
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def stop() -> None:
        server.should_exit = True

    ready = Ready(name, stop)
    app = build_app(ready.loader(engine_factory(
        args.model, args.device, args.dtype, adapters, args.max_model_len, args.model_impl, args.speculative,
        args.weights, args.draft_model)), config,
                    model_name=name)
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.grace,
                                   log_level="info", http=header_deadline_protocol(
                                       config.header_timeout_s, max_connections=config.max_connections,
                                       retry_after_s=config.retry_after_s)), app.state.kev, args.grace)
    server.run()
    return LOAD_FAILED if ready.failure is not None else 0
