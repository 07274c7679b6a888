"""Intake: prompts and settings in, each request ready to queue — or its own error — out.

Where this sits: the engine's public calls (`generate`, `submit`, ...) hand their arguments here
on the caller's thread, before anything is queued. Every request is checked on its own (its
adapter known, its settings valid, its token ids inside the vocabulary, its prompt tokenized
and able to fit in the KV pool, its constraint compiled), so one bad request becomes that
request's exception and never fails its neighbours; callers that want all or nothing raise the
first (`raise_refused`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from ..adapters.pool import AdapterPool
from ..errors import InvalidRequestError, KevError
from .params import SamplingParams, coerce_sampling
from .tokenize import Prompt, encode_prompt, longest_token

SamplingArg = SamplingParams | dict[str, Any] | None
AdapterArg = str | None
Prepared = tuple[list[int], SamplingParams, AdapterArg, Any] | BaseException  # Any: its compiled grammar


def per_prompt(value: Any, count: int, what: str) -> list[Any]:
    """One value for every prompt, or a list with one each."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InvalidRequestError(f"got {len(value)} {what} for {count} prompts; give one or one each")
        return list(value)
    return [value] * count


def raise_refused(prepared: Sequence[Prepared]) -> None:
    """Raise the first refused request's error (callers that want all or nothing)."""
    for item in prepared:
        if isinstance(item, BaseException):
            raise item


class KVCapacity(Protocol):
    """What intake asks of the engine's KV pool (`model.kv_pool.KVPool`): a request that could
    never fit in it is refused before it is queued."""

    budget_bytes: int

    @property
    def capacity_tokens(self) -> int: ...


class Compiler(Protocol):
    """What intake asks of the engine's grammar compiler (`sample.grammar.Grammars`): a request's
    constraint compiled once, on its caller's thread."""

    vocab_size: int

    def compile(self, constraint: tuple[str, str], salt: str | None = None) -> Any: ...


class Intake:
    """Checks and tokenizes requests for one engine (`lock`: the engine's, guarding its adapters)."""

    def __init__(self, tokenizer: Any, max_context: int, kv: KVCapacity, grammars: Compiler, adapters: AdapterPool,
                 lock: threading.Condition) -> None:
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.longest_token = longest_token(tokenizer)  # a prompt too long by its characters is refused untokenized
        self._kv = kv
        self._grammars = grammars
        self._adapters = adapters
        self._lock = lock

    def encode(self, prompt: Prompt) -> list[int]:
        """The exact token ids fed for `prompt` (chat template applied to messages)."""
        return encode_prompt(self.tokenizer, prompt, self.max_context, self.longest_token)

    def prepare_many(self, prompts: Sequence[Any], sampling: Any, adapters: Any) -> list[Prepared]:
        """`prompts` (checked by `check_prompt_list`), with one setting and adapter for all or one
        each, prepared one by one."""
        return self.prepare(prompts, per_prompt(sampling, len(prompts), "sampling settings"),
                            per_prompt(adapters, len(prompts), "adapters"))

    def prepare(self, prompts: Sequence[Any], samplings: Sequence[Any], adapters: Sequence[Any]) -> list[Prepared]:
        """Tokenize and validate each request on its own: a bad one becomes its exception."""
        prepared: list[Prepared] = []
        for prompt, sampling, adapter in zip(prompts, samplings, adapters):
            try:
                if adapter is not None and not isinstance(adapter, str):
                    raise InvalidRequestError(f"adapter={adapter!r} is not allowed; use an adapter name or None")
                with self._lock:
                    self._adapters.check(adapter)
                params = coerce_sampling(sampling)
                self._check_token_ids(params)
                ids = _about("prompt", self.encode, prompt)
                self._check_fits(len(ids), params.max_tokens)
                # compiled here, on the caller's thread: a bad grammar fails this request alone
                compiled = None
                if params.constraint:
                    compiled = _about(params.constraint[0], self._grammars.compile, params.constraint,
                                      params.cache_salt)
                prepared.append((ids, params, adapter, compiled))
            except KevError as exc:
                prepared.append(exc)
        return prepared

    def _check_token_ids(self, params: SamplingParams) -> None:
        """Token ids a request names must be rows of this model's logits."""
        width = self._grammars.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if t >= width]
            if outside:
                raise InvalidRequestError(f"{name} names token id {outside[0]}, outside this model's vocabulary "
                                          f"(ids 0..{width - 1})", param=name)

    def _check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """A request that could never fit in the KV pool is refused now, not left waiting forever."""
        need = min(num_prompt + max_tokens, self.max_context)
        if need > self._kv.capacity_tokens:
            raise InvalidRequestError(
                f"this request may reach {need} tokens (prompt {num_prompt} + max_tokens {max_tokens}); "
                f"the KV pool holds {self._kv.capacity_tokens} tokens (kv_cache_bytes={self._kv.budget_bytes}). "
                "Lower max_tokens, shorten the prompt, or give the engine a larger kv_cache_bytes", param="max_tokens"
            )


def _about(param: str, call: Any, *args: Any) -> Any:
    """`call(*args)`; an InvalidRequestError it raises without a `param` is about `param`."""
    try:
        return call(*args)
    except InvalidRequestError as exc:
        if exc.param is None:
            exc.param = param
        raise
