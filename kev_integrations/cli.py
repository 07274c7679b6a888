"""`kev`, the installed command: the engine's commands (`kev_engine.tools.cli`) and `kev serve`.

    kev serve [--model SOURCE] [--adapter NAME=PATH] [--port 8000] [--api-key KEY]   # OpenAI-compatible
    kev serve --ray --replicas 4 [--ray-address ADDR]     # the same API from Ray Serve replicas

The server's arguments are declared without importing FastAPI, so `kev --help` works on an
install without the `server` extra and `kev serve` says what to install.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kev_engine import cli

from .server.run import add_arguments


def _serve(args: argparse.Namespace) -> int:
    from .server.run import serve, settings

    config, adapters, name = settings(args)
    if args.ray:
        from .ray.run import serve_on_ray

        return serve_on_ray(args, config, adapters, name)
    return serve(args, config, adapters, name)


SERVE = cli.Command("serve", "serve the OpenAI-compatible API (needs kev-llm[server])", add_arguments, _serve)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, extra=(SERVE,))
