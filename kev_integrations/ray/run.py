"""`kev serve --ray`: the same OpenAI-compatible API from Ray Serve replicas, until SIGTERM / Ctrl-C.

Joins the cluster at ``--ray-address`` (or ``$RAY_ADDRESS``), else starts a local Ray; Serve's
HTTP proxy binds ``--host:--port``. On SIGTERM / Ctrl-C our application is deleted: replicas get
``--grace`` seconds to finish running requests, engines close, and the process exits 0. On a
cluster it joined, it deletes only its own application and leaves Serve (and other applications)
running; a local Ray it started, it shuts down. A signal while deploying stops at once, with the
same clean-up (exit 0 for SIGTERM, 130 for Ctrl-C).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from kev_engine import TEMPERATURE_ENV
from kev_integrations.server.config import ServerConfig

APP_NAME = "kev"


def serve_on_ray(args: Any, config: ServerConfig, adapters: dict[str, str], name: str) -> int:
    try:
        import ray
        from ray import serve

        from .serve import build_app
    except ImportError as exc:
        raise SystemExit(f"kev serve --ray needs the ray extra: pip install 'kev-llm[ray]' ({exc})") from None
    if args.replicas < 1:
        raise SystemExit(f"--replicas {args.replicas}: give at least 1")
    settings = (("device", args.device), ("dtype", args.dtype), ("max_model_len", args.max_model_len),
                ("model_impl", args.model_impl), ("speculative", args.speculative), ("weights", args.weights),
                ("draft_model", args.draft_model))
    engine_kwargs = {k: v for k, v in settings if v is not None}
    joined = bool(args.ray_address or os.environ.get("RAY_ADDRESS"))
    ray.init(address=args.ray_address)
    stop = threading.Event()
    serving = False
    interrupted_by: list[int] = []

    def on_signal(signum: int, _: Any) -> None:
        if not serving or stop.is_set():  # while deploying (serve.run can wait long), or a second signal
            interrupted_by.append(signum)
            raise KeyboardInterrupt
        stop.set()

    # installed after ray.init, whose own SIGTERM handler would kill the process without a drain
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    deployed = False
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        if APP_NAME in serve.status().applications:
            raise SystemExit(f"a Serve application named {APP_NAME!r} already runs on this cluster; stop it first "
                             "(serve.delete) — kev serve --ray does not replace it")
        actor_options: dict[str, Any] | None = {"num_cpus": args.cpus_per_replica} if args.cpus_per_replica else None
        if os.environ.get(TEMPERATURE_ENV):  # replicas on other nodes do not see this shell's environment
            actor_options = {**(actor_options or {}), "runtime_env": {"env_vars": {
                TEMPERATURE_ENV: os.environ[TEMPERATURE_ENV]}}}
        app = build_app(args.model, adapters, args.replicas, served_model_name=name, config=config,
                        ray_actor_options=actor_options, max_adapters_per_replica=args.max_adapters,
                        graceful_shutdown_timeout_s=args.grace, **engine_kwargs)
        deployed = True
        serve.run(app, name=APP_NAME, route_prefix="/")
        serving = True
        print(f"kev: serving {name} from {args.replicas} Ray replica(s) on http://{args.host}:{args.port} "
              "(if Serve was already running on this cluster, its own HTTP address applies)", flush=True)
        stop.wait()
        return 0
    except KeyboardInterrupt:  # a signal during deploy: the same clean-up, then the signal's usual status
        return 130 if not interrupted_by or interrupted_by[0] == signal.SIGINT else 0
    finally:  # a second signal interrupts this clean-up; Ray is still disconnected
        try:
            if deployed:
                serve.delete(APP_NAME)  # replicas drain within --grace, engines close
            if not joined:
                serve.shutdown()
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
