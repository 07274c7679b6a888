"""LangChain's side of tool calling: tool schemas in, `ToolCall`s out.

The format itself (system prompt, constraint, `<tool_call>` parsing) is shared with LlamaIndex
in `kev_integrations.tool_format`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall, ToolCallChunk
from langchain_core.utils.function_calling import convert_to_openai_tool

from ..chat_format import call_id
from ..tool_format import split_tool_calls


def convert_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """LangChain tools, pydantic models, functions or dicts → OpenAI-style function schemas."""
    return [convert_to_openai_tool(tool) for tool in tools]


def parse_tool_calls(
    text: str, tool_names: Sequence[str] = (), finish_reason: str | None = None
) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """Split a reply into (remaining text, tool_calls, invalid_tool_calls); a call cut by
    max_tokens is an invalid call whose error says so and whose `args` are the arguments text
    written before the cut (see `split_tool_calls`); the text keeps no call markup."""
    remaining, calls, invalid = split_tool_calls(text, tool_names, finish_reason=finish_reason)
    return (
        remaining,
        [ToolCall(name=c["name"], args=c["arguments"], id=call_id(), type="tool_call") for c in calls],
        [InvalidToolCall(name=c.name, args=c.arguments, id=call_id(), error=c.error, type="invalid_tool_call")
         for c in invalid],
    )


def tool_call_chunks(calls: Sequence[ToolCall], invalid: Sequence[InvalidToolCall]) -> list[ToolCallChunk]:
    """The closing stream chunk's calls. LangChain rebuilds a streamed message's calls from these
    chunks, partially parsing their args: a cut call's ``{"a": 3, "b`` would come back as a valid
    ``{"a": 3}``, and a call cut before its arguments (``""``) as a valid call with none. So in a
    chunk an invalid call's args are its arguments text after its error in brackets, which keeps
    it invalid and keeps the reason (LangChain drops the error field when it merges chunks)."""
    chunks = [ToolCallChunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i, type="tool_call_chunk")
              for i, c in enumerate(calls)]
    chunks += [ToolCallChunk(name=c["name"], args=f"[{c['error']}] {c['args']}", id=c["id"], index=len(calls) + i,
                             type="tool_call_chunk")
               for i, c in enumerate(invalid)]
    return chunks
