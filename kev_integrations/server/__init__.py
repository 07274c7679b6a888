"""`kev serve`: an OpenAI-compatible HTTP server over one engine (extra: ``kev-llm[server]``)."""

from .app import build_app
from .config import ServerConfig

__all__ = ["ServerConfig", "build_app"]
