"""`kev serve`: an OpenAI-compatible HTTP server over one engine (extra: ``kev-llm[server]``).

`build_app` is imported on first use, so `kev --help` and the CLI's argument parsing work
without FastAPI installed; `kev serve` then says which extra to install.
"""

from __future__ import annotations

from typing import Any

from .config import ServerConfig

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(name)
