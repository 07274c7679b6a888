"""The fewest tokens a forced tool call takes, and the refusal of a `max_tokens` below it.

Where this sits: the server and ChatKev turn bound tools into the reply's constraint with
`tool_format.tool_call_constraint`; when `tool_choice` forces a call (a tool's name, or
"any"/"required"/True) they ask here, before anything is generated, whether `max_tokens` can
hold one. (LlamaIndex's Kev reports a missing required call as `ReplyParseError` when it is
read, and is not checked here yet.)

Why: the markup the constraint forces around a call's arguments —
``<tool_call>{"name": "add", "arguments": `` before them, ``}</tool_call>`` after — is about 20
tokens. A budget below it is cut inside that markup on every try, and the reply then holds no
call at all (LangChain's ``with_structured_output(method="function_calling")`` returns None for
it): the constraint the caller forced would be defeated without a word. So it is refused up
front, naming `max_tokens`, the minimum and why. A call cut later, inside its arguments, comes
back as cut (`tool_format.split_tool_calls`) — except a call named by `tool_choice` on the
server, which is a 400 (`server.chat_prompt.cut_forced_call`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kev_engine import InvalidRequestError

from .tool_format import call_tag, tool_call_newline, tool_choice_name

FORCING_CHOICES = ("any", "required", True)
"""`tool_choice` values that force a call of one of the bound tools (a tool's name forces that one)."""


def forced_tools(tools: Sequence[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]]:
    """The tools a reply must call one of: the named one, all of them for "any"/"required"/True,
    none when the reply may be text ("auto", "none", None)."""
    named = tool_choice_name(tool_choice, tools)
    if named is not None:
        return [tool for tool in tools if tool["function"]["name"] == named]
    if tool_choice in FORCING_CHOICES:
        return list(tools)
    return []


def shortest_call(tool: dict[str, Any], newline: bool) -> str:
    """The call's markup around empty arguments (``{}``): the text the constraint forces whatever
    the arguments, in the layout the model was shown."""
    tag = call_tag(tool, newline)
    return tag["begin"] + "{}" + tag["end"]


def check_forced_call_budget(
    max_tokens: int, tools: Sequence[dict[str, Any]], tool_choice: Any, tokenizer: Any,
    count_tokens: Callable[[str], int],
) -> None:
    """Raise `InvalidRequestError` (param "max_tokens") when `tool_choice` forces a call and
    `max_tokens` is below the tokens of the shortest call's markup (`shortest_call`, counted by
    `count_tokens` with the model's tokenizer): that reply is cut inside the markup every time.

    Counting is skipped where the budget is surely enough: a text of B bytes is at most B + 1
    tokens (each token covers one byte or more; a SentencePiece tokenizer may add one prefix
    token), so the usual budgets never tokenize anything, and a remote engine is not asked.
    """
    forced = forced_tools(tools, tool_choice)
    if not forced:
        return
    texts = [shortest_call(tool, tool_call_newline(tokenizer)) for tool in forced]
    if max_tokens >= min(len(text.encode()) + 1 for text in texts):
        return
    minimum, text = min((count_tokens(text), text) for text in texts)
    if max_tokens >= minimum:
        return
    which = f"a call of {forced[0]['function']['name']!r}" if len(forced) == 1 else "a call of one of the tools"
    raise InvalidRequestError(
        f"max_tokens={max_tokens} is too small for the tool call that tool_choice={_choice(tool_choice)} forces: "
        f"its markup alone, {text} with empty arguments, takes {minimum} tokens with this model's tokenizer, so "
        f"{which} would be cut before it was complete (finish_reason 'length') and the reply would hold no "
        f"call; use max_tokens >= {minimum}, plus what the arguments need", param="max_tokens",
    )


def _choice(tool_choice: Any) -> str:
    """`tool_choice` as the caller wrote it, short."""
    return repr(tool_choice)[:120]
