"""OpenAI chat messages (and tools) → the engine's chat prompt, and a reply's tool calls back.

The messages map to `kev_integrations.chat_format`'s turns, so a conversation gets the prompt it
gets through LangChain or LlamaIndex; only OpenAI's own checks (roles, content parts, the tools'
shape) are made here, as 400s naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..chat_format import ToolCall, Turn, arguments_of, build_prompt, call_id, offered_tools, role_of
from ..tool_format import split_tool_calls
from .errors import APIError, bad_request

TEXT_PART_TYPES = ("text", "input_text")
# OpenAI's chat roles: any other string would reach the chat template, which renders most as
# they are ("<|im_start|>alien") and gives the model a turn it was never trained on
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_IDS_SHOWN = 20  # the call ids an unmatched tool reply's error lists (a long agent loop makes many)


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


def _calls(message: Mapping[str, Any], index: int) -> tuple[ToolCall, ...]:
    where = f"messages[{index}].tool_calls"
    raw = message.get("tool_calls") or []
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be a list of {{'id', 'type': 'function', 'function': "
                          "{'name', 'arguments'}}", param=where)
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}[{j}] must be {{'id': str, 'type': 'function', 'function': {{'name': str, "
                              "'arguments': JSON text}}}}", param=f"{where}[{j}]")
        if not isinstance(call.get("id"), str) or not call["id"]:  # as OpenAI: the tool reply names it
            raise bad_request(f"{where}[{j}].id is missing: each tool call needs its id (a string), which the "
                              "tool message answering it repeats as tool_call_id", param=f"{where}[{j}].id")
        arguments = function.get("arguments", "{}")
        try:
            calls.append(ToolCall(function["name"], arguments_of(arguments), call["id"]))
        except ValueError as exc:
            if not isinstance(arguments, str):
                raise bad_request(f"{where}[{j}].function.arguments: {exc}",
                                  param=f"{where}[{j}].function.arguments") from None
            # text that is no JSON object: a call cut by max_tokens, as this server replies it; it goes
            # back into the history as written (the tool message answering it says how it failed)
            calls.append(ToolCall(function["name"], arguments, call["id"]))
    return tuple(calls)


def _turn(message: Any, index: int) -> Turn:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise bad_request(f"messages[{index}] must be an object with a 'role'", param=f"messages[{index}]")
    role = message["role"]
    if role not in ROLES:
        raise bad_request(f"messages[{index}] has role={role[:100]!r}; allowed roles: {list(ROLES)}",
                          param=f"messages[{index}].role")
    content = _text(message.get("content"), index) or ""
    name = message.get("name") if isinstance(message.get("name"), str) else None
    if role == "assistant":
        return Turn("assistant", content, _calls(message, index))
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is None:  # as OpenAI: a tool reply says which call it answers
            raise bad_request(f"messages[{index}].tool_call_id is missing: a tool message answers one tool call "
                              "and names its id", param=f"messages[{index}].tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"messages[{index}].tool_call_id must be a string, got {type(call_id).__name__}",
                              param=f"messages[{index}].tool_call_id")
        return Turn("tool", content, tool_call_id=call_id)
    return Turn(role_of(role), content, name=name if role == "user" else None)


def _check_tool_replies(turns: Sequence[Turn]) -> None:
    """Each tool message answers a call an earlier assistant message made, as OpenAI requires: a
    reply to no call would reach the model as a result nobody asked for (and a template that
    writes calls natively would pair it with nothing)."""
    made: list[str] = []
    for index, turn in enumerate(turns):
        made += [call.id for call in turn.tool_calls if call.id is not None]
        if turn.role != "tool" or turn.tool_call_id in made:
            continue
        shown = made[-MAX_IDS_SHOWN:]
        known = (f"the calls made before it have the ids {shown}"
                 + (f" (the last {len(shown)} of {len(made)})" if len(made) > len(shown) else "")
                 if made else "no earlier assistant message made a tool call")
        raise bad_request(f"messages[{index}].tool_call_id={(turn.tool_call_id or '')[:100]!r} answers no tool "
                          f"call of an earlier assistant message; {known}", param=f"messages[{index}].tool_call_id")


def chat_prompt(messages: Sequence[Any], tools: Sequence[Mapping[str, Any]], tool_choice: Any,
                tokenizer: Any) -> tuple[Any, list[str]]:
    """The engine prompt for these messages and the names of the tools offered (empty: none)."""
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                              "{...}}}}", param=f"tools[{i}]")
    turns = [_turn(m, i) for i, m in enumerate(messages)]
    _check_tool_replies(turns)
    prompt = build_prompt(turns, tools, tool_choice, tokenizer)
    return prompt, [t["function"]["name"] for t in offered_tools(tools, tool_choice)]


def reply_tool_calls(
    text: str, tool_names: Sequence[str], finish_reason: str | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """A reply's text and its tool calls in OpenAI's shape (arguments as JSON text).

    The text never holds call markup. A call that does not parse (only possible when max_tokens
    cut it) comes as OpenAI sends one: in the calls, its `arguments` the text written before the
    cut, beside `finish_reason` "length"; one cut before its name was whole has nothing to send.
    (A cut call that `tool_choice` named never gets here: `cut_forced_call` makes it a 400.)
    """
    remaining, calls, invalid = split_tool_calls(text, tool_names, finish_reason=finish_reason)
    written = [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
    written += [(c.name, c.arguments) for c in invalid if c.name is not None]
    return remaining, [
        {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in written
    ]


def cut_forced_call(text: str, tool_names: Sequence[str], finish_reason: str | None, forced: str | None,
                    max_tokens: int, where: str = "") -> APIError | None:
    """The 400 for a reply that max_tokens cut before the call `tool_choice` named (`forced`) was
    whole, else None. `where`: which choice, when there are several.

    Why not OpenAI's 200 with the cut call: a named tool_choice is how clients ask for one
    structure (langchain-openai's ``with_structured_output(method="function_calling")``,
    instructor), and langchain-openai's parsers skip a call whose arguments do not parse, so they
    return None — the forced structure silently missing. "required"/"any" keep OpenAI's shape:
    an agent sees the cut call and calls again.
    """
    if forced is None or finish_reason != "length":
        return None
    _, calls, _ = split_tool_calls(text, tool_names, finish_reason=finish_reason)
    if any(call["name"] == forced for call in calls):  # whole: only its closing tag was cut
        return None
    return APIError(400, f"max_tokens={max_tokens} cut the call of {forced!r} that tool_choice forces before it "
                    f"was complete (finish_reason 'length'){where}; the reply holds no call to return. Raise "
                    "max_tokens: the call's arguments need more tokens", param="max_tokens", code="tool_call_cut")
