"""OpenAI chat messages (and tools) → the engine's chat prompt, and a reply's tool calls back.

The same conventions as the LangChain and LlamaIndex front ends (`kev_integrations.tool_format`):
a template that renders tools itself gets them natively; otherwise the tools are described in
a system message and earlier calls / results are written in the ``<tool_call>`` text format.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ..tool_format import (
    format_tool_call,
    format_tool_result,
    split_tool_calls,
    template_supports_tools,
    tool_system_prompt,
)
from .errors import bad_request

TEXT_PART_TYPES = ("text", "input_text")
# OpenAI's chat roles: any other string would reach the chat template, which renders most as
# they are ("<|im_start|>alien") and gives the model a turn it was never trained on
ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, index: int) -> str | None:
    """A message's content as text; OpenAI's list of parts is joined, non-text parts refused."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in TEXT_PART_TYPES:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise bad_request(f"messages[{index}] has a content part of type {kind!r}; Kev models take text only",
                                  param=f"messages[{index}].content")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts",
                      param=f"messages[{index}].content")


def _arguments(call: Mapping[str, Any], index: int) -> dict[str, Any]:
    raw = (call.get("function") or {}).get("arguments", "{}")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        raise bad_request(f"messages[{index}] has a tool call whose arguments are not JSON: {raw!r}",
                          param=f"messages[{index}].tool_calls") from None
    return args if isinstance(args, dict) else {}


def _message(message: Any, index: int, native: bool, names: dict[str, str]) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise bad_request(f"messages[{index}] must be an object with a 'role'", param=f"messages[{index}]")
    role = message["role"]
    if role not in ROLES:
        raise bad_request(f"messages[{index}] has role={role[:100]!r}; allowed roles: {list(ROLES)}",
                          param=f"messages[{index}].role")
    content = _text(message.get("content"), index)
    calls = message.get("tool_calls") or []
    if role == "assistant" and calls:
        for call in calls:
            names[call.get("id", "")] = (call.get("function") or {}).get("name", "")
        if native:
            return {"role": "assistant", "content": content or "", "tool_calls": [
                {"type": "function", "id": c.get("id"), "function": {
                    "name": (c.get("function") or {}).get("name"), "arguments": _arguments(c, index)}}
                for c in calls]}
        written = "".join(format_tool_call((c.get("function") or {}).get("name", ""), _arguments(c, index))
                          for c in calls)
        return {"role": "assistant", "content": ((content or "") + "\n" + written).strip()}
    if role == "tool":
        if native:
            return {"role": "tool", "content": content or "", "tool_call_id": message.get("tool_call_id")}
        return {"role": "user", "content": format_tool_result(names.get(message.get("tool_call_id", "")),
                                                              content or "")}
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    return {"role": role, "content": content if content is not None else ""}


def chat_prompt(messages: Sequence[Any], tools: Sequence[Mapping[str, Any]], tool_choice: Any,
                tokenizer: Any) -> tuple[Any, list[str]]:
    """The engine prompt for these messages and the names of the tools offered (empty: none)."""
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                              "{...}}}}", param=f"tools[{i}]")
    offered = list(tools) if tool_choice != "none" else []
    native = bool(offered) and template_supports_tools(tokenizer)
    names: dict[str, str] = {}
    converted = [_message(m, i, native, names) for i, m in enumerate(messages)]
    tool_names = [t["function"]["name"] for t in offered]
    if not offered:
        return converted, []
    if native:
        return {"messages": converted, "tools": [dict(t) for t in offered]}, tool_names
    system = tool_system_prompt([dict(t) for t in offered], tool_choice)
    if converted and converted[0]["role"] == "system":
        converted[0] = {**converted[0], "content": converted[0]["content"] + "\n\n" + system}
    else:
        converted.insert(0, {"role": "system", "content": system})
    return converted, tool_names


def reply_tool_calls(
    text: str, tool_names: Sequence[str], finish_reason: str | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """A reply's text and its tool calls in OpenAI's shape (arguments as JSON text).

    The text never holds call markup. A call that does not parse (only possible when max_tokens
    cut it) comes as OpenAI sends one: in the calls, its `arguments` the text written before the
    cut, beside `finish_reason` "length"; one cut before its name was whole has nothing to send.
    """
    remaining, calls, invalid = split_tool_calls(text, tool_names, finish_reason=finish_reason)
    written = [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
    written += [(c.name, c.arguments) for c in invalid if c.name is not None]
    return remaining, [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in written
    ]
