"""LlamaIndex chat messages ↔ the engine's chat prompts, and tool calls in and out.

Where this sits: `Kev.chat` turns LlamaIndex `ChatMessage`s (and bound tools) into the prompt
the engine renders with the model's chat template, and turns the reply back into an assistant
`ChatMessage` whose `additional_kwargs["tool_calls"]` hold the parsed calls — the shape
`get_tool_calls_from_response` and LlamaIndex's agents read. Templates that render tools get
them natively; the others (the embedded SmolLM2's) get them described in a system message and
see earlier calls and results written as ``<tool_call>`` / ``<tool_response>`` text.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.output_parsers.base import OutputParserException

from ..tool_format import (
    format_tool_call,
    format_tool_result,
    split_tool_calls,
    tool_choice_instruction,
    tool_system_prompt,
)


class ReplyParseError(OutputParserException, ValueError):
    """A reply that does not parse as what was asked (a tool call, a structured object).

    With constrained decoding this only happens when the reply was cut short, so the message
    always names the reply's `finish_reason` ("length": `max_tokens` ran out mid-object).
    """

    def __init__(self, message: str, finish_reason: str | None) -> None:
        super().__init__(message)
        self.finish_reason = finish_reason


def cut_reason(finish_reason: str | None, completion_tokens: int | None) -> str:
    """Why a reply may be incomplete, in words a user can act on."""
    if finish_reason == "length":
        return (f"the reply was cut by max_tokens after {completion_tokens} tokens (finish_reason='length'): "
                "raise max_tokens")
    return f"the reply ended with finish_reason={finish_reason!r}"


def tool_schemas(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """OpenAI-style function schemas of LlamaIndex tools (schemas given as dicts pass through)."""
    return [t if isinstance(t, dict) else t.metadata.to_openai_tool(skip_length_check=True) for t in tools or ()]


def _calls_of(message: ChatMessage) -> list[dict[str, Any]]:
    """A history message's tool calls as {"id", "name", "arguments"}: Kev's own, OpenAI's
    (``{"function": {...}}`` dicts or objects) or `ToolCallBlock`s, so a memory filled by
    another LLM still replays."""
    calls = []
    for call in message.additional_kwargs.get("tool_calls") or ():
        if not isinstance(call, dict):  # an OpenAI SDK object
            call = {"id": call.id, "function": {"name": call.function.name, "arguments": call.function.arguments}}
        function = call.get("function", call)
        calls.append({"id": call.get("id"), "name": function["name"], "arguments": function.get("arguments", {})})
    if not calls:
        calls = [{"id": b.tool_call_id, "name": b.tool_name, "arguments": b.tool_kwargs}
                 for b in message.blocks if isinstance(b, ToolCallBlock)]
    for call in calls:
        if isinstance(call["arguments"], str):
            call["arguments"] = json.loads(call["arguments"] or "{}")
    return calls


def to_engine_messages(messages: Sequence[ChatMessage], native_tools: bool) -> list[dict[str, Any]]:
    """`ChatMessage`s → `{"role", "content", ...}` dicts for the chat template."""
    out: list[dict[str, Any]] = []
    names: dict[str | None, str] = {}  # tool_call_id → tool name: tool results carry only the id
    for message in messages:
        role, content = message.role.value, message.content or ""
        calls = _calls_of(message) if message.role == MessageRole.ASSISTANT else []
        names.update({c["id"]: c["name"] for c in calls})
        call_id = message.additional_kwargs.get("tool_call_id")
        if calls and native_tools:
            written = [{"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                       for c in calls]
            out.append({"role": "assistant", "content": content, "tool_calls": written})
        elif calls:
            text = "".join(format_tool_call(c["name"], c["arguments"]) for c in calls)
            out.append({"role": "assistant", "content": (content + "\n" + text).strip()})
        elif message.role == MessageRole.TOOL and native_tools:
            out.append({"role": "tool", "content": content, "tool_call_id": call_id})
        elif message.role == MessageRole.TOOL:
            name = message.additional_kwargs.get("name") or names.get(call_id)
            out.append({"role": "user", "content": format_tool_result(name, content)})
        else:
            out.append({"role": role, "content": content})
    return out


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Add `text` to the first system message, or start the conversation with one."""
    if not text:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def chat_prompt(
    messages: Sequence[ChatMessage], tools: list[dict[str, Any]], tool_choice: Any, native_tools: bool
) -> Any:
    """The engine prompt of one chat call: tools natively (``{"messages", "tools"}``) or described."""
    converted = to_engine_messages(messages, native_tools)
    if not tools:
        return converted
    if native_tools:  # the template lists the tools; it has no tool_choice, so say it in words
        return {"messages": with_system(converted, tool_choice_instruction(tool_choice, tools)), "tools": tools}
    return with_system(converted, tool_system_prompt(tools, tool_choice))


def assistant_message(text: str, tool_names: Sequence[str] = (), finish_reason: str | None = None) -> ChatMessage:
    """The reply as an assistant message: calls parsed into ``additional_kwargs["tool_calls"]``,
    the text around them the content (never call markup). Calls that do not parse — cut by
    max_tokens, even inside the opening tag — are kept as ``{"name", "arguments", "error"}`` in
    ``additional_kwargs["invalid_tool_calls"]`` (`arguments`: the arguments text written, not
    the call's wrapper) for `tool_selections` to report."""
    rest, calls, invalid = split_tool_calls(text, tool_names, finish_reason=finish_reason)
    extra: dict[str, Any] = {}
    if calls:
        extra["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", **c} for c in calls]
    if invalid:
        extra["invalid_tool_calls"] = [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in invalid]
    return ChatMessage(role=MessageRole.ASSISTANT, content=rest, additional_kwargs=extra)


def tool_selections(
    message: ChatMessage, raw: Any, error_on_no_tool_call: bool
) -> list[ToolSelection]:
    """The `ToolSelection`s of a reply. A call that did not parse raises `ReplyParseError`
    saying why the reply ended (never dropped silently); no call at all raises only when
    `error_on_no_tool_call`."""
    raw = raw if isinstance(raw, dict) else {}
    usage = raw.get("usage") or {}
    if invalid := message.additional_kwargs.get("invalid_tool_calls"):
        reason = cut_reason(raw.get("finish_reason"), usage.get("completion_tokens"))
        bad = invalid[0]
        what = f"tool call {bad['name']!r}" if bad["name"] else "a tool call"
        what += f" with arguments {bad['arguments']!r}" if bad["arguments"] else ""
        raise ReplyParseError(f"{what} does not parse ({bad['error']}); {reason}", raw.get("finish_reason"))
    calls = _calls_of(message)
    if not calls and error_on_no_tool_call:
        raise ValueError(f"expected a tool call in the answer, got: {message.content!r}")
    return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"]) for c in calls]
