"""Structured prediction for LlamaIndex through a JSON-schema constraint.

Where this sits: `Kev.structured_predict` and its async / streaming twins (which
`as_structured_llm` uses) call these free functions, typed against LlamaIndex's public `LLM`.
Each formats the prompt, asks the LLM's `chat` for a reply constrained to the output class's JSON schema
(`SamplingParams(json_schema=cls)`), and validates it. The reply
parses by construction, so a failure means it was cut short: the error says so, with the
reply's finish_reason. Each call is one engine request, so concurrent calls with different
schemas still share packed passes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator
from typing import Any, TypeVar

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictInProgressEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms import LLM
from llama_index.core.program.utils import process_streaming_objects
from llama_index.core.prompts import BasePromptTemplate
from pydantic import BaseModel, ValidationError

from ..chat_format import schema_instruction
from .messages import ReplyParseError, cut_reason

Model = TypeVar("Model", bound=BaseModel)
dispatcher = instrument.get_dispatcher(__name__)


def structured_messages(
    llm: LLM, output_cls: type[BaseModel], prompt: BasePromptTemplate, prompt_args: dict[str, Any]
) -> list[ChatMessage]:
    """The prompt's messages, the LLM's system prompt, and the schema instruction."""
    messages = prompt.format_messages(llm=llm, **prompt_args)
    if llm.system_prompt:  # as LlamaIndex's own predict does
        messages = [ChatMessage(role=MessageRole.SYSTEM, content=llm.system_prompt), *messages]
    instruction = schema_instruction(output_cls.model_json_schema())
    if messages and messages[0].role == MessageRole.SYSTEM:
        first = ChatMessage(role=MessageRole.SYSTEM, content=f"{messages[0].content or ''}\n\n{instruction}")
        return [first, *messages[1:]]
    return [ChatMessage(role=MessageRole.SYSTEM, content=instruction), *messages]


def parse_reply(output_cls: type[Model], response: ChatResponse) -> Model:
    """The reply as `output_cls`, or a `ReplyParseError` saying why the reply ended."""
    text = response.message.content or ""
    raw = response.raw if isinstance(response.raw, dict) else {}
    finish_reason = raw.get("finish_reason")
    reason = cut_reason(finish_reason, (raw.get("usage") or {}).get("completion_tokens"))
    if finish_reason == "length":
        raise ReplyParseError(f"the {output_cls.__name__} object is incomplete: {reason}; got {text!r}", finish_reason)
    try:
        return output_cls.model_validate_json(text)
    except ValidationError as exc:
        raise ReplyParseError(
            f"the reply does not validate as {output_cls.__name__} ({reason}): {exc}; got {text!r}", finish_reason
        ) from exc


def _start(output_cls: type[BaseModel], prompt: BasePromptTemplate, prompt_args: dict[str, Any]) -> None:
    dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args))


def predict(
    llm: LLM, output_cls: type[Model], prompt: BasePromptTemplate,
    llm_kwargs: dict[str, Any] | None, prompt_args: dict[str, Any],
) -> Model:
    """One constrained chat call, validated."""
    _start(output_cls, prompt, prompt_args)
    messages = structured_messages(llm, output_cls, prompt, prompt_args)
    result = parse_reply(output_cls, llm.chat(messages, json_schema=output_cls, **(llm_kwargs or {})))
    dispatcher.event(LLMStructuredPredictEndEvent(output=result))
    return result


async def apredict(
    llm: LLM, output_cls: type[Model], prompt: BasePromptTemplate,
    llm_kwargs: dict[str, Any] | None, prompt_args: dict[str, Any],
) -> Model:
    """`predict` awaiting the engine: gathered calls share packed passes."""
    _start(output_cls, prompt, prompt_args)
    messages = structured_messages(llm, output_cls, prompt, prompt_args)
    result = parse_reply(output_cls, await llm.achat(messages, json_schema=output_cls, **(llm_kwargs or {})))
    dispatcher.event(LLMStructuredPredictEndEvent(output=result))
    return result


class _Partials:
    """Partial objects as the JSON grows (LlamaIndex's own repair of incomplete JSON), then
    the validated object from the final chunk (the one carrying usage)."""

    def __init__(self, output_cls: type[BaseModel]) -> None:
        self.output_cls = output_cls
        self.current: list[Any] | None = None

    def next(self, chunk: ChatResponse) -> Any:
        if chunk.raw:  # the last chunk: the whole reply, checked strictly
            result = parse_reply(self.output_cls, chunk)
            dispatcher.event(LLMStructuredPredictEndEvent(output=result))
            return result
        partial = process_streaming_objects(chunk, self.output_cls, cur_objects=self.current, flexible_mode=True)
        self.current = [partial]
        dispatcher.event(LLMStructuredPredictInProgressEvent(output=partial))
        return partial


def stream(
    llm: LLM, output_cls: type[BaseModel], prompt: BasePromptTemplate,
    llm_kwargs: dict[str, Any] | None, prompt_args: dict[str, Any],
) -> Generator[Any, None, None]:
    """Partial objects while the reply streams, the validated object last."""
    _start(output_cls, prompt, prompt_args)
    messages = structured_messages(llm, output_cls, prompt, prompt_args)
    partials = _Partials(output_cls)
    for chunk in llm.stream_chat(messages, json_schema=output_cls, **(llm_kwargs or {})):
        yield partials.next(chunk)


async def astream(
    llm: LLM, output_cls: type[BaseModel], prompt: BasePromptTemplate,
    llm_kwargs: dict[str, Any] | None, prompt_args: dict[str, Any],
) -> AsyncGenerator[Any, None]:
    """`stream` on an event loop."""
    _start(output_cls, prompt, prompt_args)
    messages = structured_messages(llm, output_cls, prompt, prompt_args)
    partials = _Partials(output_cls)
    async for chunk in await llm.astream_chat(messages, json_schema=output_cls, **(llm_kwargs or {})):
        yield partials.next(chunk)
