"""LangChain messages ↔ the engine's chat prompts and `Completion`s (ChatKev's conversion layer)."""

from __future__ import annotations

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

from .. import chat_format
from ..chat_format import ToolCall, Turn, role_of
from ..logprob_format import chat_logprobs


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


def to_turns(messages: Sequence[BaseMessage]) -> list[Turn]:
    """LangChain messages → the neutral turns every front end's prompt is built from."""
    turns: list[Turn] = []
    for message in messages:
        content = text_of(message.content)
        if isinstance(message, ChatMessage):
            turns.append(Turn(role_of(message.role), content))
        elif isinstance(message, AIMessage):
            calls = tuple(ToolCall(c["name"], c["args"], c.get("id")) for c in message.tool_calls)
            turns.append(Turn("assistant", content, calls))
        elif isinstance(message, ToolMessage):
            turns.append(Turn("tool", content, tool_call_id=message.tool_call_id, name=message.name))
        elif isinstance(message, HumanMessage):
            turns.append(Turn("user", content, name=message.name))
        elif isinstance(message, SystemMessage):
            turns.append(Turn("system", content))
        else:
            raise TypeError(f"message of type {type(message).__name__} is not supported")
    return turns


def build_prompt(
    messages: Sequence[BaseMessage],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    tokenizer: Any,
    instructions: str = "",
) -> Any:
    """The engine prompt for one chat call (`kev_integrations.chat_format.build_prompt`)."""
    return chat_format.build_prompt(to_turns(messages), tools, tool_choice, tokenizer, instructions)


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
