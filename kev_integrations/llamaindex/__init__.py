"""LlamaIndex front end: `Kev`, an LLM whose concurrent calls share packed passes, and
`scoped`, per-call settings for query engines that pass no kwargs to their LLM."""

from .llm import Kev, parse_tool_calls
from .scoped import current_overrides, scoped

__all__ = ["Kev", "current_overrides", "parse_tool_calls", "scoped"]
