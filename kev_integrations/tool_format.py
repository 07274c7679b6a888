"""Tool calls in text, Hermes/Qwen style, for both front ends.

Templates that know tools (``"tools"`` appears in the template) get the JSON schemas natively
(``{"messages": ..., "tools": ...}`` prompts). Templates that ignore tools — the embedded
SmolLM2 one does — get the schemas and the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
format described in a system message instead. Replies are parsed for that format either way
(plus a bare JSON object naming a known tool, which some models emit).

`tool_call_constraint` turns the bound tools and `tool_choice` into an xgrammar structural tag,
so the engine generates calls in that same format by construction: the name is one of the
bound tools and the arguments match that tool's schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TAG = "<tool_call>"
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else json.dumps(template)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument itself."""
    return "tools" in _template_text(tokenizer)


def tool_call_newline(tokenizer: Any) -> bool:
    """Whether constrained calls use the ``<tool_call>\\n{...}\\n</tool_call>`` layout: only when the
    model's own template renders the tools and writes calls that way (Qwen, Hermes); Kev's tool
    prompt teaches the one-line layout, and the constraint must match what the model was shown."""
    template = _template_text(tokenizer)
    # a Jinja string literal spells the newline as backslash-n; a raw template block has it as is
    return template_supports_tools(tokenizer) and ("<tool_call>\\n" in template or "<tool_call>\n" in template)


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


def tool_choice_name(tool_choice: Any, tools: Sequence[dict[str, Any]]) -> str | None:
    """The tool a named `tool_choice` forces ("name" or OpenAI's {"type": "function", ...}), else None."""
    if isinstance(tool_choice, dict):
        tool_choice = tool_choice.get("function", {}).get("name") or tool_choice.get("name")
    names = {t["function"]["name"] for t in tools}
    return tool_choice if isinstance(tool_choice, str) and tool_choice in names else None


def call_tag(tool: dict[str, Any], newline: bool) -> dict[str, Any]:
    """One tool's call: its name fixed in the opening text, its arguments by its JSON schema."""
    function = tool["function"]
    gap = "\n" if newline else ""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "tag",
        "begin": f'<tool_call>{gap}{{"name": {json.dumps(function["name"], ensure_ascii=False)}, "arguments": ',
        # at most one whitespace between JSON tokens: unbounded, small models write "\n \t\r\n..." until max_tokens
        "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": 1},
        "end": "}" + gap + "</tool_call>",
    }


def tool_call_constraint(
    tools: Sequence[dict[str, Any]], tool_choice: Any, tokenizer: Any, *, parallel: bool = True
) -> dict[str, Any] | None:
    """The structural tag a reply with these tools bound must match (None: no constraint).

    "auto"/None: free text, and any ``<tool_call>`` it opens is a valid call; "any"/"required"/
    True: one or more calls and nothing else; a tool's name: exactly one call of that tool;
    "none"/False: free text that never opens a call. `parallel=False` allows one call at most.
    The layout follows the model's template (`tool_call_newline`), decided here once for every
    front end, so the constraint always matches what the model was shown.
    """
    if not tools:
        return None
    if tool_choice in ("none", False):
        return {"type": "structural_tag", "format": {"type": "any_text", "excludes": ["<tool_call>"]}}
    tool_choice_instruction(tool_choice, tools)  # an unknown choice raises, naming the allowed ones
    newline = tool_call_newline(tokenizer)
    tags = [call_tag(tool, newline) for tool in tools]
    forced = tool_choice_name(tool_choice, tools)
    if forced is not None:
        fmt: dict[str, Any] = next(t for t, tool in zip(tags, tools) if tool["function"]["name"] == forced)
    elif tool_choice in ("any", "required", True):
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel}
    else:
        fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags, "stop_after_first": not parallel}
    return {"type": "structural_tag", "format": fmt}


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


def format_tool_call(name: str, args: dict[str, Any] | str) -> str:
    """A previous tool call written back into a history, in the format the model was taught; a cut
    call's arguments (text, see `ToolCall`) as they were written."""
    if isinstance(args, str):
        return f'<tool_call>{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}</tool_call>'
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "</tool_call>"


_PROBE = "kev-role-probe-5e1d"
_renders_role: dict[tuple[str, str], bool] = {}


def template_renders_role(tokenizer: Any, role: str) -> bool:
    """Whether the chat template writes a message of `role` as it is (generic templates such as
    SmolLM2's ``<|im_start|>{{ role }}``), rather than refusing or dropping it. Rendered once per
    template and role.

    Why it matters: a template that ignores tools can still show a tool's result in a ``tool``
    turn, and small models answer from that far better than from a ``<tool_response>`` user
    turn, which they copy instead (measured on SmolLM2-135M, the four questions of
    examples/langchain_agent.py: from a ``tool`` turn 2 of 4 answers state the tool's result;
    from a user turn 0 of 4 do — three echo the ``<tool_response>`` tag).
    """
    key = (_template_text(tokenizer), role)
    if key not in _renders_role:
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                   {"role": role, "content": _PROBE}]
        try:
            text = tokenizer.apply_chat_template(history, tokenize=False)
            _renders_role[key] = isinstance(text, str) and _PROBE in text and role in text.replace(_PROBE, "")
        except Exception:  # noqa: BLE001 - a template that raises on the role does not render it
            _renders_role[key] = False
    return _renders_role[key]


def format_tool_result(name: str | None, content: str) -> str:
    """A tool's result written into a history for templates without a `tool` role."""
    return "<tool_response>" + json.dumps({"name": name, "content": content}, ensure_ascii=False) + "</tool_response>"


def parse_call(raw: str) -> dict[str, Any]:
    """One `{"name", "arguments"}` JSON call; raises ValueError/KeyError/TypeError if it is not one."""
    data = json.loads(raw)
    name = data["name"]
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(name, str) or not isinstance(args, dict):
        raise TypeError("name must be a string and arguments an object")
    return {"name": name, "arguments": args}


CUT_BY_MAX_TOKENS = "cut by max_tokens (finish_reason='length') before the call was complete; raise max_tokens"
CUT_INSIDE_TAG = "cut inside the <tool_call> tag by max_tokens (finish_reason='length'); raise max_tokens"
_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS_RE = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class InvalidCall:
    """A ``<tool_call>`` that does not parse, as far as it was written.

    `arguments` is the arguments text only (cut where the reply was cut), never the
    ``{"name": ..., "arguments": ...}`` wrapper: what OpenAI's ``function.arguments`` and
    LangChain's ``InvalidToolCall.args`` hold.
    """

    name: str | None
    """The tool's name; None when the reply ended before the name was written whole."""
    arguments: str
    error: str


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag` (a reply cut inside the tag)."""
    for size in range(len(tag) - 1, 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def visible_text(text: str) -> str:
    """What of a reply still being streamed is surely no call markup: the text before its first
    ``<tool_call>``, less an end that may be the start of one (with tools bound, the prose streams
    and calls come parsed at the end)."""
    head = text.split(TAG, 1)[0]
    return head[: len(head) - _partial_suffix(head, TAG)]


def _value_end(text: str) -> int:
    """Where the JSON value `text` starts with ends: its closing bracket or quote, else before the
    wrapper's next `,` or `}` (a scalar), else the end of `text` (the value was cut)."""
    depth, in_string, escaped = 0, False, False
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]" or (char == "," and depth == 0):
            if depth == 0:
                return i
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _invalid_call(raw: str, error: str, cut: bool) -> InvalidCall:
    """What a call that does not parse names and passes (`raw`: the text between the tags)."""
    found = _ARGUMENTS_RE.search(raw)
    head = raw[: found.start()] if found else raw  # a "name" inside the arguments is not the tool's
    named = _NAME_RE.search(head)
    try:
        name = json.loads(f'"{named.group(1)}"') if named else None
    except ValueError:
        name = None
    if found:
        value = raw[found.end() :]
        arguments = value[: _value_end(value)].strip()
        if arguments.startswith('"'):  # arguments written as a JSON string: its text, when it is whole
            try:
                arguments = str(json.loads(arguments))
            except ValueError:
                pass
    else:  # cut (or written) before any arguments: none; no wrapper at all: the text is all there is
        arguments = "" if cut or named else raw
    return InvalidCall(name, arguments, error)


def split_tool_calls(
    text: str, tool_names: Sequence[str] = (), *, finish_reason: str | None = None
) -> tuple[str, list[dict[str, Any]], list[InvalidCall]]:
    """Split a reply into (remaining text, calls as {"name", "arguments"}, calls that do not parse).

    The remaining text never holds call markup, whatever became of the call: every front end
    shows it as the reply's content. Exact repeats of a call (same name, same arguments) are
    kept once: a small model under a "call one or more tools" constraint tends to write the same
    call again and again until max_tokens, and running a tool twice with the same arguments in
    one turn never adds an answer. A last call left open by ``finish_reason="length"`` is
    invalid, its error saying it was cut by max_tokens (never dropped, never half-parsed) —
    unless only its closing tag was cut, the call itself complete; a reply cut inside the
    opening tag (tools bound) is an invalid call with neither name nor arguments.
    """
    matches = list(TOOL_CALL_RE.finditer(text))
    if not matches:
        stripped = text.strip()
        if stripped.startswith("{") and tool_names:  # a bare JSON call naming a known tool
            try:
                call = parse_call(stripped)
            except (ValueError, KeyError, TypeError):
                return text, [], []
            if call["name"] in tool_names:
                return "", [call], []
    calls: list[dict[str, Any]] = []
    invalid: list[InvalidCall] = []
    for match in matches:
        raw = match.group(1)
        cut = finish_reason == "length" and match is matches[-1] and not match.group(0).endswith("</tool_call>")
        if cut:  # cut inside the closing tag, the call itself complete: keep it
            raw = raw[: len(raw) - _partial_suffix(raw, "</tool_call>")].rstrip()
        try:
            call = parse_call(raw)
        except (ValueError, KeyError, TypeError) as exc:
            invalid.append(_invalid_call(raw, CUT_BY_MAX_TOKENS if cut else f"{type(exc).__name__}: {exc}", cut))
            continue
        if call not in calls:
            calls.append(call)
    rest = TOOL_CALL_RE.sub("", text)
    opened = _partial_suffix(rest, TAG) if tool_names and finish_reason == "length" else 0
    if opened and not (matches and matches[-1].end() == len(text)):
        rest = rest[:-opened]
        invalid.append(InvalidCall(None, "", CUT_INSIDE_TAG))
    elif not matches:
        return text, [], []
    return rest.strip(), calls, invalid
