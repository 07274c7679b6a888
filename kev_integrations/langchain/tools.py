"""Tool calling through the model's chat template, Hermes/Qwen style.

Templates that know tools (``"tools"`` appears in the template) get the JSON schemas natively
(``{"messages": ..., "tools": ...}`` prompts). Templates that ignore tools — the embedded
SmolLM2 one does — get the schemas and the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
format described in a system message instead. Replies are parsed for that format either way
(plus a bare JSON object naming a bound tool, which some models emit).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall
from langchain_core.utils.function_calling import convert_to_openai_tool

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def convert_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """LangChain tools, pydantic models, functions or dicts → OpenAI-style function schemas."""
    return [convert_to_openai_tool(tool) for tool in tools]


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument itself."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in (template if isinstance(template, str) else json.dumps(template))


def tool_choice_instruction(tool_choice: Any, tools: Sequence[dict[str, Any]]) -> str:
    """A sentence steering the model when the caller requires a tool (templates have no tool_choice)."""
    if tool_choice in (None, "auto", "none", False):
        return ""
    if isinstance(tool_choice, dict):  # {"type": "function", "function": {"name": ...}}
        tool_choice = tool_choice.get("function", {}).get("name") or tool_choice.get("name")
    names = {t["function"]["name"] for t in tools}
    if isinstance(tool_choice, str) and tool_choice in names:
        return f"You must call the function {tool_choice}."
    if tool_choice in ("any", "required", True):
        return "You must call one of the functions."
    raise ValueError(f"tool_choice={tool_choice!r} is not allowed; use 'auto', 'any', 'none' or one of {sorted(names)}")


def tool_system_prompt(tools: Sequence[dict[str, Any]], tool_choice: Any = None) -> str:
    """The Hermes-style description of the tools, for templates that ignore `tools`."""
    lines = [
        "You may call one or more functions to answer the user. Function signatures, as JSON schemas:",
        "<tools>",
        *(json.dumps(tool, ensure_ascii=False) for tool in tools),
        "</tools>",
        "To call a function, reply with a JSON object with the function name and its arguments inside "
        "<tool_call></tool_call> tags, for example:",
        '<tool_call>{"name": "function_name", "arguments": {"arg": "value"}}</tool_call>',
    ]
    if instruction := tool_choice_instruction(tool_choice, tools):
        lines.append(instruction)
    return "\n".join(lines)


def format_tool_call(name: str, args: dict[str, Any]) -> str:
    """A previous tool call written back into a history, in the format the model was taught."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "</tool_call>"


def format_tool_result(name: str | None, content: str) -> str:
    """A tool's result written into a history for templates without a `tool` role."""
    return "<tool_response>" + json.dumps({"name": name, "content": content}, ensure_ascii=False) + "</tool_response>"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse_one(raw: str) -> ToolCall | InvalidToolCall:
    try:
        data = json.loads(raw)
        name = data["name"]
        args = data.get("arguments", data.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        if not isinstance(name, str) or not isinstance(args, dict):
            raise TypeError("name must be a string and arguments an object")
    except (ValueError, KeyError, TypeError) as exc:
        return InvalidToolCall(name=None, args=raw, id=_call_id(), error=f"{type(exc).__name__}: {exc}",
                               type="invalid_tool_call")
    return ToolCall(name=name, args=args, id=_call_id(), type="tool_call")


def parse_tool_calls(
    text: str, tool_names: Sequence[str] = ()
) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """Split a reply into (remaining text, tool_calls, invalid_tool_calls)."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    matches = list(TOOL_CALL_RE.finditer(text))
    if not matches:
        stripped = text.strip()
        if stripped.startswith("{") and tool_names:  # a bare JSON call naming a bound tool
            parsed = _parse_one(stripped)
            if parsed.get("type") == "tool_call" and parsed["name"] in tool_names:
                return "", [parsed], []  # type: ignore[list-item]
        return text, [], []
    for match in matches:
        parsed = _parse_one(match.group(1))
        (calls if parsed.get("type") == "tool_call" else invalid).append(parsed)  # type: ignore[arg-type]
    return TOOL_CALL_RE.sub("", text).strip(), calls, invalid
