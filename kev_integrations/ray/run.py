"""`kev serve --ray`: the same OpenAI-compatible API from Ray Serve replicas, until SIGTERM / Ctrl-C.

Joins the cluster at ``--ray-address`` (or ``$RAY_ADDRESS``), else starts a local Ray; Serve's
HTTP proxy binds ``--host:--port``. On SIGTERM / Ctrl-C the application is deleted: replicas get
``--grace`` seconds to finish running requests, engines close, and the process exits 0.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from kev_integrations.server.config import ServerConfig


def serve_on_ray(args: Any, config: ServerConfig, adapters: dict[str, str], name: str) -> int:
    try:
        import ray
        from ray import serve

        from .serve import build_app
    except ImportError as exc:
        raise SystemExit(f"kev serve --ray needs the ray extra: pip install 'kev-llm[ray]' ({exc})") from None
    if args.replicas < 1:
        raise SystemExit(f"--replicas {args.replicas}: give at least 1")
    engine_kwargs = {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v is not None}
    ray.init(address=args.ray_address)
    stop = threading.Event()  # after ray.init, which installs a SIGTERM handler of its own that kills the process
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        options = {"num_cpus": args.cpus_per_replica} if args.cpus_per_replica else None
        app = build_app(args.model, adapters, args.replicas, served_model_name=name, config=config,
                        ray_actor_options=options,
                        max_adapters_per_replica=args.max_adapters, graceful_shutdown_timeout_s=args.grace,
                        **engine_kwargs)
        serve.run(app, name="kev", route_prefix="/")
        print(f"kev: serving {name} from {args.replicas} Ray replica(s) on http://{args.host}:{args.port}", flush=True)
        stop.wait()
        serve.delete("kev")  # replicas drain within --grace, engines close
        serve.shutdown()
    finally:
        ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
