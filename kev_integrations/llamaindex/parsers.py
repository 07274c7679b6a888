"""What a LlamaIndex output parser will read, as the constraint on the reply it reads.

Where this sits: LlamaIndex components that read JSON from an LLM's text — `LLMQuestionGenerator`
(SubQuestionQueryEngine's sub-questions), `LLMSingleSelector` / `LLMMultiSelector`
(RouterQueryEngine's choice), anything with a `PydanticOutputParser` — call
``llm.predict(prompt, **prompt_args)`` and hand the reply to the prompt's output parser. They
pass the LLM no settings, so `Kev.predict` asks `parser_constraint` what that parser accepts and
runs the call in a `scoped` JSON-schema constraint: the reply parses by construction whatever the
model's size (unconstrained, SmolLM2-135M copies the prompt's few-shot example and never closes
the JSON). A parser not known here adds nothing; give its calls one with ``scoped(json_schema=...)``.

The schemas are as narrow as the prompt allows: a sub-question's `tool_name` is one of the tools
the prompt lists, a selection's `choice` one of the numbered choices — a reply naming no tool or
choice 7 of 2 would parse and then fail further on. Free-text fields are bounded
(`MAX_TEXT_CHARS`) and so are lists, so a small model's reply ends within a modest `max_tokens`
instead of looping inside a string until it is cut.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llama_index.core.output_parsers.selection import SelectionOutputParser
from llama_index.core.question_gen.output_parser import SubQuestionOutputParser
from pydantic import BaseModel

MAX_TEXT_CHARS = 120
"""Longest sub-question or selection reason: a sentence, about 30 tokens. At most 128: xgrammar
(0.2.9) masks a pattern's repetition bounded above 128 on a slow path, three orders of magnitude
slower per token than at 128 — more than the model's step costs."""
MAX_SUB_QUESTIONS_PER_TOOL = 2
"""Sub-questions per listed tool (LlamaIndex's own few-shot example asks two of each tool)."""


def _text() -> dict[str, Any]:
    """A bounded free-text string. Bounded by a pattern, not maxLength: xgrammar (0.2.9) compiles
    a maxLength string to any character but quote, backslash and newlines, control characters
    included, and JSON parsers refuse those raw in a string (a random-weight model writes them);
    the pattern leaves them, quotes and backslashes out (so no escapes either: plain text, which
    is all these fields need)."""
    return {"type": "string", "pattern": rf'^[^"\\\u0000-\u001f]{{1,{MAX_TEXT_CHARS}}}$'}


def _tool_names(tools_str: Any) -> list[str]:
    """The tool names of `LLMQuestionGenerator`'s ``tools_str`` ({name: description} as JSON)."""
    try:
        tools = json.loads(tools_str) if isinstance(tools_str, str) else None
    except ValueError:
        return []
    return [name for name in tools if isinstance(name, str)] if isinstance(tools, dict) else []


def sub_question_schema(tool_names: list[str]) -> dict[str, Any]:
    """`SubQuestionList`'s shape (``{"items": [{"sub_question", "tool_name"}]}``, what the prompt's
    example shows), each `tool_name` one of `tool_names` (any string when none are known)."""
    tool_name: dict[str, Any] = {"enum": tool_names} if tool_names else _text()
    item = {"type": "object", "properties": {"sub_question": _text(), "tool_name": tool_name},
            "required": ["sub_question", "tool_name"], "additionalProperties": False}
    items: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if tool_names:
        items["maxItems"] = MAX_SUB_QUESTIONS_PER_TOOL * len(tool_names)
    return {"type": "object", "properties": {"items": items}, "required": ["items"], "additionalProperties": False}


def selection_schema(num_choices: int, max_outputs: int) -> dict[str, Any]:
    """`SelectionOutputParser`'s list of ``{"choice", "reason"}`` (its format's example), the
    choice one of 1..`num_choices`, at most `max_outputs` of them."""
    answer = {"type": "object", "properties": {"choice": {"enum": list(range(1, num_choices + 1))}, "reason": _text()},
              "required": ["choice", "reason"], "additionalProperties": False}
    return {"type": "array", "items": answer, "minItems": 1, "maxItems": max(1, max_outputs)}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parser_constraint(parser: Any, prompt_args: Mapping[str, Any]) -> dict[str, Any]:
    """The constraint kwargs for a reply `parser` reads, given the prompt's arguments; {} for a
    parser not known here (or a selection prompt without its `num_choices`)."""
    if isinstance(parser, SubQuestionOutputParser):
        return {"json_schema": sub_question_schema(_tool_names(prompt_args.get("tools_str")))}
    if isinstance(parser, SelectionOutputParser):
        num_choices = _positive_int(prompt_args.get("num_choices"))
        if num_choices is None:
            return {}
        # LLMMultiSelector passes max_outputs; LLMSingleSelector does not, and reads one answer
        max_outputs = _positive_int(prompt_args.get("max_outputs")) or 1
        return {"json_schema": selection_schema(num_choices, min(max_outputs, num_choices))}
    output_cls = getattr(parser, "output_cls", None)  # PydanticOutputParser
    if isinstance(output_cls, type) and issubclass(output_cls, BaseModel):
        return {"json_schema": output_cls.model_json_schema()}
    return {}
