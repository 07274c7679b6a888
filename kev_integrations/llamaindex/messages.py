"""LlamaIndex chat messages ↔ the engine's chat prompts, and tool calls in and out.

Where this sits: `Kev.chat` turns LlamaIndex `ChatMessage`s (and bound tools) into the prompt
the engine renders with the model's chat template, and turns the reply back into an assistant
`ChatMessage` whose `additional_kwargs["tool_calls"]` hold the parsed calls — the shape
`get_tool_calls_from_response` and LlamaIndex's agents read. Templates that render tools get
them natively; the others (the embedded SmolLM2's) get them described in a system message and
see earlier calls written as ``<tool_call>`` text — the rules of every front end, in
`kev_integrations.chat_format`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.output_parsers.base import OutputParserException

from ..chat_format import ToolCall, Turn, arguments_of, build_prompt, call_id, role_of
from ..tool_format import split_tool_calls


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


def _calls_of(message: ChatMessage) -> list[ToolCall]:
    """A history message's tool calls: Kev's own, OpenAI's (``{"function": {...}}`` dicts or
    objects) or `ToolCallBlock`s, so a memory filled by another LLM still replays."""
    calls = []
    for call in message.additional_kwargs.get("tool_calls") or ():
        if not isinstance(call, dict):  # an OpenAI SDK object
            call = {"id": call.id, "function": {"name": call.function.name, "arguments": call.function.arguments}}
        function = call.get("function", call)
        calls.append(ToolCall(function["name"], arguments_of(function.get("arguments", {})), call.get("id")))
    if not calls:
        calls = [ToolCall(b.tool_name, arguments_of(b.tool_kwargs), b.tool_call_id)
                 for b in message.blocks if isinstance(b, ToolCallBlock)]
    return calls


def to_turns(messages: Sequence[ChatMessage]) -> list[Turn]:
    """`ChatMessage`s → the neutral turns every front end's prompt is built from."""
    turns = []
    for message in messages:
        role, content = role_of(message.role.value), message.content or ""
        if role == "assistant":
            turns.append(Turn(role, content, tuple(_calls_of(message))))
        elif role == "tool":
            turns.append(Turn(role, content, tool_call_id=message.additional_kwargs.get("tool_call_id"),
                              name=message.additional_kwargs.get("name")))
        else:
            turns.append(Turn(role, content))
    return turns


def chat_prompt(messages: Sequence[ChatMessage], tools: list[dict[str, Any]], tool_choice: Any, tokenizer: Any) -> Any:
    """The engine prompt of one chat call (`kev_integrations.chat_format.build_prompt`)."""
    return build_prompt(to_turns(messages), tools, tool_choice, tokenizer)


def assistant_message(text: str, tool_names: Sequence[str] = (), finish_reason: str | None = None) -> ChatMessage:
    """The reply as an assistant message: calls parsed into ``additional_kwargs["tool_calls"]``,
    the text around them the content (never call markup). Calls that do not parse — cut by
    max_tokens, even inside the opening tag — are kept as ``{"name", "arguments", "error"}`` in
    ``additional_kwargs["invalid_tool_calls"]`` (`arguments`: the arguments text written, not
    the call's wrapper) for `tool_selections` to report."""
    rest, calls, invalid = split_tool_calls(text, tool_names, finish_reason=finish_reason)
    extra: dict[str, Any] = {}
    if calls:
        extra["tool_calls"] = [{"id": call_id(), **c} for c in calls]
    if invalid:
        extra["invalid_tool_calls"] = [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in invalid]
    return ChatMessage(role=MessageRole.ASSISTANT, content=rest, additional_kwargs=extra)


def failed_selection(bad: Mapping[str, Any]) -> ToolSelection:
    """A call that did not parse (an ``invalid_tool_calls`` entry), as a selection no tool answers
    to: it must never run (its arguments were cut), yet an agent must see it fail rather than die.
    Its name — the tool's, then why it was not run — has spaces, so it is no tool's name, and
    LlamaIndex's agents answer it as they answer any unknown tool: an error result (`is_error`)
    that names it, and another turn for the model. Its id is derived from the call, so asking
    twice for one reply's selections (FunctionAgent does) gives the same id."""
    name = f"{bad['name'] or 'tool call'} (not run: {bad['error']})"
    digest = hashlib.sha256(json.dumps(dict(bad), sort_keys=True).encode()).hexdigest()
    return ToolSelection(tool_id=f"call_{digest[:24]}", tool_name=name, tool_kwargs={})


def tool_selections(
    message: ChatMessage, raw: Any, error_on_no_tool_call: bool
) -> list[ToolSelection]:
    """The `ToolSelection`s of a reply. A call that did not parse is never dropped silently: when
    a call is required (`error_on_no_tool_call`, as `predict_and_call` asks) it raises
    `ReplyParseError` saying why the reply ended; otherwise (FunctionAgent's way) it comes back
    after the valid calls as a `failed_selection`, which the agent answers with an error result.
    No call at all raises only when `error_on_no_tool_call`."""
    raw = raw if isinstance(raw, dict) else {}
    usage = raw.get("usage") or {}
    invalid = message.additional_kwargs.get("invalid_tool_calls") or []
    if invalid and error_on_no_tool_call:
        reason = cut_reason(raw.get("finish_reason"), usage.get("completion_tokens"))
        bad = invalid[0]
        what = f"tool call {bad['name']!r}" if bad["name"] else "a tool call"
        what += f" with arguments {bad['arguments']!r}" if bad["arguments"] else ""
        raise ReplyParseError(f"{what} does not parse ({bad['error']}); {reason}", raw.get("finish_reason"))
    calls = _calls_of(message)
    if not calls and error_on_no_tool_call:
        raise ValueError(f"expected a tool call in the answer, got: {message.content!r}")
    # `_calls_of` gives objects; arguments_of narrows ToolCall.arguments (dict | str) for the type checker
    return ([ToolSelection(tool_id=c.id or "", tool_name=c.name, tool_kwargs=arguments_of(c.arguments)) for c in calls]
            + [failed_selection(bad) for bad in invalid])
