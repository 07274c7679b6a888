"""LangChain messages ↔ the engine's chat prompts and `Completion`s (ChatKev's conversion layer)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata

from kev_engine import Completion

from ..logprob_format import chat_logprobs
from ..tool_format import format_tool_call, format_tool_result, tool_choice_instruction, tool_system_prompt

ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


def text_of(content: str | list[Any]) -> str:
    """Text of a message's content; non-text blocks (images, audio, files) are refused by name."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") in ("text", "text-plain"):
            parts.append(block.get("text", ""))
        elif isinstance(block, dict) and block.get("type") in ("tool_use", "tool_call", "reasoning", "thinking"):
            continue  # carried by the message's tool_calls / not replayed
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"content block of type {kind!r} is not supported; Kev models take text only")
    return "".join(parts)


def to_engine_messages(
    messages: Sequence[BaseMessage], native_tools: bool, tool_role: bool = False
) -> list[dict[str, Any]]:
    """LangChain messages → `{"role", "content"}` dicts for the chat template.

    With `native_tools` the template renders tool calls and `tool` messages itself; otherwise
    calls are written as the `<tool_call>` text the system prompt describes, and a tool's result
    as a plain ``tool`` turn when the template writes any role as it is (`tool_role`, see
    `template_renders_role`), else as a `<tool_response>` user turn.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        content = text_of(message.content)
        if isinstance(message, ChatMessage):
            out.append({"role": message.role, "content": content})
        elif isinstance(message, AIMessage) and message.tool_calls:
            if native_tools:
                calls = [
                    {"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": c["args"]}}
                    for c in message.tool_calls
                ]
                out.append({"role": "assistant", "content": content, "tool_calls": calls})
            else:
                written = "".join(format_tool_call(c["name"], c["args"]) for c in message.tool_calls)
                out.append({"role": "assistant", "content": (content + "\n" + written).strip()})
        elif isinstance(message, ToolMessage):
            if native_tools:
                out.append({"role": "tool", "content": content, "tool_call_id": message.tool_call_id})
            elif tool_role:
                out.append({"role": "tool", "content": content})
            else:
                out.append({"role": "user", "content": format_tool_result(message.name, content)})
        elif isinstance(message, (HumanMessage, SystemMessage, AIMessage)):
            entry: dict[str, Any] = {"role": ROLES[message.type], "content": content}
            if isinstance(message, HumanMessage) and message.name:
                entry["name"] = message.name
            out.append(entry)
        else:
            raise TypeError(f"message of type {type(message).__name__} is not supported")
    return out


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Add `text` to the first system message, or start the conversation with one."""
    if not text:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": text + "\n\n" + messages[0]["content"]}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def build_prompt(
    messages: Sequence[BaseMessage],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    native_tools: bool,
    system_extra: str = "",
    tool_role: bool = False,
) -> Any:
    """The engine prompt for one chat call: messages, plus tools natively or described in text."""
    engine_messages = to_engine_messages(messages, native_tools, tool_role)
    if tools and not native_tools:
        system_extra = (tool_system_prompt(tools, tool_choice) + "\n\n" + system_extra).strip()
    elif tools:
        system_extra = (tool_choice_instruction(tool_choice, tools) + "\n\n" + system_extra).strip()
    engine_messages = with_system(engine_messages, system_extra)
    if tools and native_tools:
        return {"messages": engine_messages, "tools": tools}
    return engine_messages


def usage_of(completion: Completion) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=completion.prompt_tokens,
        output_tokens=completion.completion_tokens,
        total_tokens=completion.prompt_tokens + completion.completion_tokens,
    )


def response_metadata(completion: Completion, model_name: str) -> dict[str, Any]:
    """ChatKev's response_metadata; with logprobs asked for, ``logprobs`` in ChatOpenAI's shape."""
    metadata: dict[str, Any] = {
        "model_name": model_name,
        "model_provider": "kev",
        "finish_reason": completion.finish_reason,
        "adapter": completion.adapter,
    }
    if completion.logprobs is not None:
        metadata["logprobs"] = chat_logprobs(completion.logprobs)
    return metadata


def schema_instruction(schema: dict[str, Any] | None) -> str:
    """The system sentence for JSON output (`with_structured_output` / `response_format`).

    The engine enforces the schema itself, so this only has to tell the model what each key
    means. An object's keys are listed in one plain sentence: small models follow that far
    better than a JSON Schema dump (measured on SmolLM2-135M, greedy, the five joke prompts of
    LangChain's standard tests: 4 of 5 replies complete within 64 tokens with the key list, 1 of
    5 with the dump; the others loop inside the first string until max_tokens). Other schemas
    are given as JSON.
    """
    if schema is None:
        return "Reply with one JSON object and nothing else."
    properties = schema.get("properties")
    if schema.get("type", "object") == "object" and isinstance(properties, dict) and properties:
        keys = ", ".join(f"{json.dumps(name)} ({spec.get('description') or spec.get('type') or 'any value'})"
                         for name, spec in properties.items() if isinstance(spec, dict))
        return "Reply with one JSON object with these keys: " + keys
    return "Reply with JSON that matches this JSON schema, and nothing else:\n" + json.dumps(schema)
