"""`KevLLM`: a LangChain text-completion LLM over the Kev engine.

A prompt string is the user's turn: on a model with a chat template it is sent as one user
message (as Ollama's generate endpoint does), so an instruct model answers it instead of ending
at once; ``chat_template=False`` sends it as raw text to continue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun, Callbacks
from langchain_core.language_models import BaseLLM
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import BaseMessage, get_buffer_string
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import Field

from kev_engine import Completion, EngineLike, InvalidRequestError

from ..init_args import SETTING_KEYS
from ..logprob_format import text_logprobs
from ..tokens import prompt_token_count
from . import calls
from .calls import EngineRequest
from .configurable import KevConfigurableFields
from .settings import KevFields


def _generation(completion: Completion) -> Generation:
    return Generation(text=completion.text, generation_info=_info(completion))


def _info(completion: Completion) -> dict[str, Any]:
    info: dict[str, Any] = {
        "finish_reason": completion.finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "adapter": completion.adapter,
    }
    if completion.logprobs is not None:  # OpenAI completions' shape, as langchain-openai's OpenAI reports it
        info["logprobs"] = text_logprobs(completion.logprobs)
    return info


class KevLLM(KevFields, BaseLLM):
    """Text-completion LLM: every prompt of a `generate`/`batch` call answered in ONE packed pass.

    A prompt string is what a user asks: with ``chat_template=None`` (the default) it goes to
    the model as ONE USER MESSAGE through the model's chat template when the model has one, and
    as raw text only when it has none. ``chat_template=False`` always sends raw text to continue
    (base models, or your own template written into the prompt); ``chat_template=True`` insists
    on the template. This is the rule of every Kev front end: ``ChatKev`` and LlamaIndex's
    ``Kev.complete`` treat a string the same way; only the engine API (``Engine.generate``)
    takes a string as raw text.

    Setup:
        ``pip install "kev-llm[langchain]"``; the embedded SmolLM2-135M-Instruct works offline.
        Construction loads nothing; the engine is shared per (model, device, dtype).

    Key init args: same as `ChatKev` — model, device, dtype, adapters, engine, or base_url,
    api_key and max_retries for a ``kev serve`` (engine side);
    adapter, temperature, top_p, top_k, max_tokens, stop, seed, cache_salt, timeout, n,
    logprobs, top_logprobs, presence_penalty, frequency_penalty, repetition_penalty, min_p,
    logit_bias, stop_token_ids, min_tokens, ignore_eos (per call;
    also via ``.bind(...)``, ``invoke(..., **kwargs)`` and ``configurable_fields``); chat_template.
    Unknown arguments are refused (``num_predict`` → use ``max_tokens``).

    Constrained replies (at most one per call, the same settings as the engine's): json_schema,
    json_object, regex, choice, grammar, structural_tag — e.g. a classifier over a whole batch in
    one packed pass, each reply exactly one of the labels:

        .. code-block:: python

            KevLLM(choice=["positive", "negative"]).batch(reviews)
            llm.invoke("Give the year", regex="[0-9]{4}")

    Instantiate / invoke / batch:
        .. code-block:: python

            from kev_integrations.langchain import KevLLM

            llm = KevLLM(max_tokens=48)
            llm.invoke("What is the capital of France?")   # a user message to an instruct model
            KevLLM(chat_template=False).invoke("The capital of France is")   # raw continuation
            chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
            chain.batch(questions)                      # one packed prefill pass for all questions

    Stream / async:
        .. code-block:: python

            for piece in llm.stream("Once upon a time"): print(piece, end="")
            await llm.ainvoke("Once upon a time")

    Output: ``generation_info`` has finish_reason ("stop" | "length"), prompt/completion tokens,
    adapter, and with ``logprobs=True`` ``logprobs`` in OpenAI completions' shape (``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``); ``generate(prompts, n=4)`` gives 4
    generations per prompt (its prompt computed once); ``llm_output`` has ``token_usage`` and
    ``model_name``. The LLM cache key holds every setting (adapter, temperature, ...), however
    it was passed. ``timeout`` bounds every wait, sync or async: the request is cancelled and
    TimeoutError names the timeout.

    Token counts (``get_num_tokens``, ``trim_messages(token_counter=llm)``) use the model's own
    tokenizer and template, offline.
    """

    chat_template: bool | None = Field(default=None)
    """None = a prompt is one user message when the model has a chat template, else raw text;
    True = always a user message (an error for a model without a template); False = raw text."""

    @property
    def _llm_type(self) -> str:
        return "kev"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**self.settings_params(), "chat_template": self.chat_template}

    def engine_prompt(self, text: str, engine: EngineLike) -> Any:
        """What the engine gets for a prompt string (see the class docstring)."""
        has_template = bool(getattr(engine.tokenizer, "chat_template", None))
        if self.chat_template is True and not has_template:
            raise InvalidRequestError(
                f"chat_template=True but the model {engine.name!r} has no chat template; "
                "use chat_template=None or False"
            )
        if self.chat_template is False or not has_template:
            return text
        return [{"role": "user", "content": text}]

    def _request(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> EngineRequest:
        sampling, adapter = self.resolve(stop, kwargs)
        engine = self.get_engine()
        return EngineRequest(engine, self.engine_prompt(prompt, engine), sampling, adapter)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Exactly the prompt tokens `invoke(messages)` feeds: the messages as one text (as
        LangChain hands them to an LLM), through the same template rule as any prompt."""
        if tools:
            raise ValueError("KevLLM takes no tools; count with ChatKev.get_num_tokens_from_messages(..., tools=...)")
        if not messages:
            return 0
        engine = self.get_engine()
        return prompt_token_count(engine, self.engine_prompt(get_buffer_string(messages), engine))

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kev"
        params["ls_model_name"] = kwargs.get("model", self.model_name)
        return params

    # BaseLLM's cache key ignores per-call kwargs; settings passed that way move onto a cheap
    # copy of the model (same engine) so they become part of the key.
    def generate(  # type: ignore[override]
        self, prompts: list[str], stop: list[str] | None = None, callbacks: Callbacks = None, **kwargs: Any
    ) -> LLMResult:
        settings = {k: kwargs.pop(k) for k in SETTING_KEYS if k in kwargs}
        if settings:
            return self.model_copy(update=settings).generate(prompts, stop, callbacks, **kwargs)
        return super().generate(prompts, stop, callbacks, **kwargs)

    async def agenerate(  # type: ignore[override]
        self, prompts: list[str], stop: list[str] | None = None, callbacks: Callbacks = None, **kwargs: Any
    ) -> LLMResult:
        settings = {k: kwargs.pop(k) for k in SETTING_KEYS if k in kwargs}
        if settings:
            return await self.model_copy(update=settings).agenerate(prompts, stop, callbacks, **kwargs)
        return await super().agenerate(prompts, stop, callbacks, **kwargs)

    def _result(self, completions: list[Completion]) -> LLMResult:
        """One list of generations per prompt: its n samples (one when n = 1)."""
        prompt_tokens = sum(c.prompt_tokens for c in completions)
        completion_tokens = sum(s.completion_tokens for c in completions for s in c.samples or (c,))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return LLMResult(
            generations=[[_generation(s) for s in c.samples or (c,)] for c in completions],
            llm_output={"token_usage": usage, "model_name": self.model_name},
        )

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """All prompts at once: submitted while the engine is held, so they share one packed pass."""
        requests = [self._request(p, stop, dict(kwargs)) for p in prompts]
        return self._result(calls.wait(calls.submit_all(requests), self.timeout))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """Truly async: each prompt's engine future is awaited; held together, they share one pass."""
        requests = [self._request(p, stop, dict(kwargs)) for p in prompts]
        return self._result(await calls.await_all(calls.submit_all(requests), self.timeout))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for piece in calls.stream(self._request(prompt, stop, kwargs)):
            if isinstance(piece, str):
                chunk = GenerationChunk(text=piece)
                if run_manager:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
            else:
                yield GenerationChunk(text="", generation_info=_info(piece))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        async for piece in calls.astream(self._request(prompt, stop, kwargs)):
            if isinstance(piece, str):
                chunk = GenerationChunk(text=piece)
                if run_manager:
                    await run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
            else:
                yield GenerationChunk(text="", generation_info=_info(piece))

    def configurable_fields(self, **kwargs: Any) -> KevConfigurableFields:
        """Per-input settings whose batches still run as one packed pass."""
        super().configurable_fields(**kwargs)  # validates the field names
        return KevConfigurableFields(default=self, fields=kwargs)
