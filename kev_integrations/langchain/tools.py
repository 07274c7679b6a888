"""LangChain's side of tool calling: tool schemas in, `ToolCall`s out.

The format itself (system prompt, `<tool_call>` parsing) is shared with LlamaIndex in
`kev_integrations.tool_format`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall
from langchain_core.utils.function_calling import convert_to_openai_tool

from ..tool_format import split_tool_calls


def convert_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """LangChain tools, pydantic models, functions or dicts → OpenAI-style function schemas."""
    return [convert_to_openai_tool(tool) for tool in tools]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(
    text: str, tool_names: Sequence[str] = ()
) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """Split a reply into (remaining text, tool_calls, invalid_tool_calls)."""
    remaining, calls, invalid = split_tool_calls(text, tool_names)
    return (
        remaining,
        [ToolCall(name=c["name"], args=c["arguments"], id=_call_id(), type="tool_call") for c in calls],
        [InvalidToolCall(name=None, args=raw, id=_call_id(), error=error, type="invalid_tool_call")
         for raw, error in invalid],
    )
