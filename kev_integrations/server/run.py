"""`kev serve`: load the model in the background, serve the OpenAI-compatible API with uvicorn.

SIGTERM / Ctrl-C: uvicorn stops accepting connections, lets running requests (streams too)
finish for up to `--grace` seconds, then the app's shutdown closes the engine, failing whatever
is still queued with a clear error. Nothing here binds beyond loopback without an API key.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from typing import Any

from kev_engine import Engine
from kev_engine.loader import EMBEDDED_NAME

from .config import ServerConfig, check_exposure

log = logging.getLogger("kev.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local folder, .gguf file or hub id (default: embedded SmolLM2-135M)")
    parser.add_argument("--served-model-name", dest="served_name", help="the `model` id clients send "
                        "(default: the --model value, or the embedded model's name)")
    parser.add_argument("--adapter", dest="adapter_specs", action="append", default=[], metavar="NAME=PATH",
                        help="load a PEFT LoRA folder as NAME, served as model id NAME (repeatable)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1... (default: cuda if available)")
    parser.add_argument("--dtype", help="float32, bfloat16, float16 (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", dest="api_keys", action="append", metavar="KEY",
                        help="accept this bearer key on /v1 and /metrics (repeatable; default: $KEV_API_KEY)")
    parser.add_argument("--admin-key", dest="admin_key", help="bearer key of /admin (default: $KEV_ADMIN_KEY; "
                        "without one the admin endpoints are off)")
    parser.add_argument("--insecure-no-auth", dest="no_auth", action="store_true",
                        help="allow a non-loopback --host without an API key")
    parser.add_argument("--shared-prefix-cache", dest="shared_prefix_cache", action="store_true",
                        help="let all API keys share one prefix cache. RISK: a caller can then learn from "
                        "cached_tokens and answer times whether another sent a given prompt (CVE-2025-46570). "
                        "Default: each key is a tenant with its own cache namespace (without keys, all callers "
                        "are one tenant)")
    parser.add_argument("--max-requests-per-key", dest="max_requests_per_key", type=int, default=128,
                        help="requests one API key may have in flight before 429 (default 128)")
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


def engine_factory(model: str | None, device: str | None, dtype: str | None,
                   adapters: dict[str, str]) -> Callable[[], Engine]:
    def load() -> Engine:
        engine = Engine.from_pretrained(model, device=device, dtype=dtype)
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        log.info("kev: %s ready%s", engine.name, f" with adapters {sorted(adapters)}" if adapters else "")
        return engine
    return load


def serve(args: Any) -> int:
    """Run the server until SIGTERM / Ctrl-C; returns the exit status."""
    try:
        import uvicorn

        from .app import build_app
        from .header_deadline import header_deadline_protocol
    except ImportError as exc:
        raise SystemExit(f"kev serve needs the server extra: pip install 'kev-llm[server]' ({exc})") from None
    config = ServerConfig.from_env(
        api_keys=tuple(args.api_keys) if args.api_keys else None, admin_key=args.admin_key,
        max_queued=args.max_queued, max_tokens_limit=args.max_tokens_limit, max_prompts=args.max_prompts,
        request_timeout_s=args.request_timeout_s, shared_prefix_cache=args.shared_prefix_cache,
        max_requests_per_key=args.max_requests_per_key,
    )
    check_exposure(args.host, config, allow_no_auth=args.no_auth)
    adapters = parse_adapter_specs(args.adapter_specs)
    name = args.served_name or args.model or EMBEDDED_NAME
    if args.ray:
        from kev_integrations.ray.run import serve_on_ray

        return serve_on_ray(args, config, adapters, name)
    if args.replicas != 1:
        raise SystemExit(f"--replicas {args.replicas} needs --ray (one process serves one engine)")
    app = build_app(engine_factory(args.model, args.device, args.dtype, adapters), config, model_name=name)

    class Server(uvicorn.Server):
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

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.grace,
                                   log_level="info", http=header_deadline_protocol(config.header_timeout_s)))
    server.run()
    return 0
