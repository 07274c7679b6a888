"""What one `ChatKev` call's reply is constrained to: bound tools or a response format → the
engine's constraint fields (`SamplingParams.structural_tag` / `json_schema` / `json_object`).

Where this sits: `ChatKev._request` merges the call's settings, then asks here what the reply
must look like. The engine makes every reply match by construction (xgrammar), so tool calls
and structured output parse whatever model runs them; the system text still describes the
tools or the schema, because a constraint fixes the shape, not the sense, of the values.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from langchain_core.utils.function_calling import convert_to_json_schema

from kev_engine import InvalidRequestError, SamplingParams

from ..tool_format import tool_call_constraint

PARALLEL_TOOL_CALLS_DEFAULT = False
"""`parallel_tool_calls` when the caller says nothing: one call per turn.

Why not OpenAI's True: Kev's parallelism is across questions (each one a row of the packed
pass), not inside one reply; and small models given "one or more calls" write the same call
again and again until max_tokens (measured on SmolLM2-135M: every question forced to call a
tool repeated its call until the budget ran out, and the last copy was cut mid-arguments).
Agents loop anyway, so a second call comes in the next turn. Pass ``parallel_tool_calls=True``
for a model that plans several calls at once; exact repeats are then collapsed when parsed.
"""


def response_format_schema(response_format: Any) -> tuple[str, dict[str, Any] | None]:
    """("json_schema", schema) | ("json_object", None) | ("text", None) for any accepted form.

    Accepted: OpenAI's ``{"type": "json_schema", "json_schema": {"name", "schema"}}`` and
    ``{"type": "json_object"}``, ``{"type": "json_schema", "schema": {...}}``, ``{"type": "text"}``,
    a pydantic class / TypedDict, or a bare JSON schema dict (as Ollama's ``format=`` takes).
    """
    if response_format is None:
        return "text", None
    if isinstance(response_format, dict) and "type" in response_format and response_format["type"] in (
        "text", "json_object", "json_mode", "json_schema"
    ):
        kind = response_format["type"]
        if kind == "text":
            return "text", None
        if kind in ("json_object", "json_mode"):
            return "json_object", None
        inner = response_format.get("json_schema", response_format)
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"response_format={response_format!r} has no JSON schema; use "
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
            )
        return "json_schema", schema
    try:
        return "json_schema", convert_to_json_schema(response_format)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"response_format={response_format!r} is not allowed: {exc}; use a pydantic class, a JSON schema "
            'dict, {"type": "json_schema", ...} or {"type": "json_object"}'
        ) from None


def tools_constraint(
    tools: list[dict[str, Any]], tool_choice: Any, parallel: bool | None, tokenizer: Any
) -> dict[str, Any]:
    """The constraint fields for a reply with `tools` bound (empty when nothing is bound)."""
    tag = tool_call_constraint(
        tools, tool_choice, tokenizer, parallel=PARALLEL_TOOL_CALLS_DEFAULT if parallel is None else parallel
    )
    return {"structural_tag": tag} if tag is not None else {}


def format_constraint(kind: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    """The constraint fields for a response format kind from `response_format_schema`."""
    if kind == "json_schema":
        return {"json_schema": schema}
    if kind == "json_object":
        return {"json_object": True}
    return {}


def constrain(sampling: SamplingParams, constraint: dict[str, Any], source: str) -> SamplingParams:
    """`sampling` with `constraint` added; a second constraint on the same reply is an error naming both."""
    if not constraint:
        return sampling
    if sampling.constraint is not None:
        raise InvalidRequestError(
            f"{source} constrains the reply, and so does {sampling.constraint[0]}=...; a reply takes one constraint"
        )
    return replace(sampling, **constraint)
