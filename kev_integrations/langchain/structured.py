"""`ChatKev.with_structured_output`: a constrained reply, then a parser whose errors are real.

Every method constrains the reply in the engine, so it parses by construction:
``json_schema`` (the default, as langchain-openai) constrains it to the schema, ``json_mode`` to
any JSON object, ``function_calling`` to exactly one call of the schema's tool. What can still
go wrong is reported, never returned as None: a reply cut by max_tokens (finish_reason
"length"), a value the schema's validators refuse, a call the model did not make.
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any, Literal

from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, Generation
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

Method = Literal["json_schema", "function_calling", "json_mode"]
METHODS = ("json_schema", "function_calling", "json_mode")
CUT_REPLY = "the reply was cut by max_tokens (finish_reason='length') before its JSON was complete; raise max_tokens"


def finish_reason(result: list[Generation]) -> str | None:
    """The finish reason of a (possibly streamed) generation."""
    generation = result[0]
    if isinstance(generation, ChatGeneration) and generation.message.response_metadata.get("finish_reason"):
        return generation.message.response_metadata["finish_reason"]
    return (generation.generation_info or {}).get("finish_reason")


class _WholeJson:
    """Refuse a JSON reply cut by max_tokens: LangChain's JSON parsing completes a partial object
    (``{"name": "Jo`` would parse as ``{"name": "Jo"}``), which would hide the cut."""

    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        if not partial and finish_reason(result) == "length":
            text = result[0].text
            try:
                json.loads(text)
            except ValueError:
                raise OutputParserException(f"{CUT_REPLY}: ...{text[-120:]!r}", llm_output=text) from None
        return super().parse_result(result, partial=partial)  # type: ignore[misc]


class KevJsonOutputParser(_WholeJson, JsonOutputParser):
    """A JSON reply as a dict (streams partial dicts); a reply cut by max_tokens raises."""


class KevPydanticOutputParser(_WholeJson, PydanticOutputParser):  # type: ignore[type-arg]
    """A JSON reply as a pydantic object; a cut reply or a refused value raises."""


class _OneCall:
    """No call at all is an error naming why (a cut call, or none), not the base parsers' None."""

    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        parsed = super().parse_result(result, partial=partial)  # type: ignore[misc]
        if parsed is None and not partial:
            message = getattr(result[0], "message", None)
            invalid = getattr(message, "invalid_tool_calls", None) or []
            reasons = "; ".join(f"{c.get('name')}: {c.get('error')}" for c in invalid) or "the model made no call"
            raise OutputParserException(f"no valid tool call to parse ({reasons})", llm_output=result[0].text)
        return parsed


class KevPydanticToolsParser(_OneCall, PydanticToolsParser):
    """The first call's arguments as a pydantic object; no valid call raises."""


class KevJsonKeyToolsParser(_OneCall, JsonOutputKeyToolsParser):
    """The first call's arguments as a dict; no valid call raises."""


def structured_output(
    llm: BaseChatModel, schema: Any, method: str, include_raw: bool, strict: bool | None
) -> Runnable[LanguageModelInput, Any]:
    """The runnable behind `ChatKev.with_structured_output` (see there)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed; use one of {list(METHODS)}")
    if schema is None and method != "json_mode":
        raise ValueError(f"method={method!r} needs a schema; only method='json_mode' takes schema=None")
    is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
    parser: Runnable[Any, Any]
    if method == "function_calling":
        name = convert_to_openai_tool(schema)["function"]["name"]
        bound = llm.bind_tools([schema], tool_choice=name, parallel_tool_calls=False,
                               ls_structured_output_format=trace)
        parser = (KevPydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                  else KevJsonKeyToolsParser(key_name=name, first_tool_only=True))
    else:
        if method == "json_schema":
            json_schema = convert_to_json_schema(schema)
            named = {"name": json_schema.get("title", "response"), "schema": json_schema}
            response_format: dict[str, Any] = {"type": "json_schema", "json_schema": named}
        else:
            response_format = {"type": "json_object"}
        bound = llm.bind(response_format=response_format, ls_structured_output_format=trace)
        parser = KevPydanticOutputParser(pydantic_object=schema) if is_pydantic else KevJsonOutputParser()
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([fallback], exception_key="parsing_error")
