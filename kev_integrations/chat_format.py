"""One chat format for every front end: neutral turns in, the engine's chat prompt out.

LangChain (`ChatKev`), LlamaIndex (`Kev`) and `kev serve` each map their own message types to
`Turn`s and nothing else; the prompt is built here, so one conversation gives the same prompt
ids — and the same greedy answer — whichever front end sent it. The rules:

- Tools the template renders itself (``"tools"`` in it) go to it natively; otherwise they are
  described in the system message and earlier calls are written in the ``<tool_call>`` text
  format (`kev_integrations.tool_format`). `tool_choice` "none" shows no tools at all.
- A tool's result is a ``tool`` turn where the template writes any role as it is (small models
  answer from it; from a ``<tool_response>`` user turn they copy the tag — see
  `template_renders_role`), else that user turn.
- Kev's own instructions (the tools, a schema) follow the caller's system message, after a blank
  line, or open the conversation as one.

Replies go back through `tool_format.split_tool_calls`; call ids come from `call_id`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .tool_format import (
    format_tool_call,
    format_tool_result,
    template_renders_role,
    template_supports_tools,
    tool_choice_instruction,
    tool_system_prompt,
)

ROLES = ("system", "user", "assistant", "tool")
ALIASES = {"developer": "system", "human": "user", "ai": "assistant", "chatbot": "assistant", "model": "assistant",
           "function": "tool"}
"""Other front ends' names for the four roles (OpenAI's developer, LangChain's human/ai, LlamaIndex's
chatbot/model/function)."""


def role_of(role: str) -> str:
    """One of `ROLES` for a front end's role name; any other is refused by name: the chat template
    would render most as they are (``<|im_start|>alien``), a turn the model was never trained on."""
    role = ALIASES.get(role, role)
    if role not in ROLES:
        raise ValueError(f"role={role[:100]!r} is not allowed; allowed roles: {[*ROLES, *ALIASES]}")
    return role


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant turn made: its tool, its arguments, its id (None: unnamed).

    `arguments` is an object — or, for a call cut by max_tokens before its arguments were complete
    (a server reply carries it so, as OpenAI's does), the text written, sent back as it came."""

    name: str
    arguments: dict[str, Any] | str
    id: str | None = None


@dataclass(frozen=True)
class Turn:
    """One message of a conversation, whichever front end it came from."""

    role: str
    """One of `ROLES`."""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant turn's calls."""
    tool_call_id: str | None = None
    """A tool turn's answer to which call."""
    name: str | None = None
    """A user turn's speaker, or a tool turn's tool (found from the call id when not given)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Turn role={self.role!r} is not allowed; allowed roles: {list(ROLES)} (see role_of)")


def arguments_of(raw: Any) -> dict[str, Any]:
    """A call's arguments as an object, from an object or its JSON text (OpenAI sends text)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise ValueError(f"tool call arguments are not JSON: {raw[:200]!r}") from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"tool call arguments must be a JSON object, got {type(raw).__name__}")
    return dict(raw)


def call_id() -> str:
    """A fresh tool call id, as OpenAI writes them (``call_`` and 24 hex characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def offered_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]]:
    """The tools the model is shown: none when `tool_choice` is "none" (never shown, never called)."""
    return [] if tool_choice in ("none", False) else [dict(t) for t in tools or ()]


def _message(turn: Turn, native: bool, tool_turn: bool, names: dict[str | None, str]) -> dict[str, Any]:
    if turn.tool_calls:
        names.update({call.id: call.name for call in turn.tool_calls})
        if native:
            return {"role": "assistant", "content": turn.content, "tool_calls": [
                {"type": "function", "id": call.id, "function": {"name": call.name, "arguments": call.arguments}}
                for call in turn.tool_calls]}
        written = "".join(format_tool_call(call.name, call.arguments) for call in turn.tool_calls)
        return {"role": "assistant", "content": (turn.content + "\n" + written).strip()}
    if turn.role == "tool":
        if native:
            return {"role": "tool", "content": turn.content, "tool_call_id": turn.tool_call_id}
        if tool_turn:
            return {"role": "tool", "content": turn.content}
        return {"role": "user", "content": format_tool_result(turn.name or names.get(turn.tool_call_id), turn.content)}
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.name and turn.role == "user":
        message["name"] = turn.name
    return message


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` after the first system message's own, or a system message opening the conversation."""
    if not text:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def build_prompt(
    turns: Sequence[Turn],
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    tokenizer: Any,
    instructions: str = "",
) -> Any:
    """The engine prompt of one chat call: a message list, or ``{"messages", "tools"}`` when the
    template renders the tools itself. `tools` are OpenAI function schemas; `instructions` is Kev's
    own system text (e.g. `schema_instruction`), placed after the tools'."""
    shown = offered_tools(tools, tool_choice)
    native = bool(shown) and template_supports_tools(tokenizer)
    tool_turn = not native and template_renders_role(tokenizer, "tool")
    names: dict[str | None, str] = {}
    messages = [_message(turn, native, tool_turn, names) for turn in turns]
    system = [tool_choice_instruction(tool_choice, shown) if native else tool_system_prompt(shown, tool_choice)
              ] if shown else []
    messages = with_system(messages, "\n\n".join(part for part in (*system, instructions) if part))
    return {"messages": messages, "tools": shown} if native else messages


def schema_instruction(schema: Mapping[str, Any] | None) -> str:
    """The system sentence for JSON output (structured output / a JSON response format).

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
