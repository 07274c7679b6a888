"""`echo` on /v1/completions: each choice's text starts with its prompt, and with `logprobs` the
prompt's tokens come with logprobs too — the first with none (null: nothing precedes it), as
OpenAI and vLLM write them. lm-eval's loglikelihood asks for exactly this: echo, `max_tokens` 0
(only the prompt) or 1, and `logprobs` 1, then reads `token_logprobs` and `top_logprobs`.

Where this sits: `app` runs `echoed_prompts` on a thread of its own beside the request's
generation (when `max_tokens` > 0), and `responses` puts each prompt in front of its choices.

A prompt's logprobs are the model's own distribution at each position (no penalty, bias,
constraint or temperature applies to a prompt), from `Engine.prompt_logprobs`: computed on the
engine's packed path, so where the engine is batch-invariant they are bitwise the same whatever
the prompt is packed with. They never start from a cached prefix (every position is computed),
so they cost a prefill of their own; a client that leaves meanwhile gets no answer, but that
prefill runs to its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kev_engine import Completion, Engine, KevError, TokenLogprob

from .errors import engine_error
from .token_prompts import prompt_text


@dataclass(frozen=True)
class EchoedPrompt:
    """What a choice repeats of its prompt."""

    text: str
    num_tokens: int
    first_token: str = ""
    """The prompt's first token, which has no logprob (only with logprobs)."""
    logprobs: list[TokenLogprob] | None = None
    """Tokens 1.. of the prompt, each with its logprob given the tokens before it; None without logprobs."""


def echoed_prompts(engine: Engine, prompts: Sequence[Any], adapter: str | None,
                   top_logprobs: int | None, fields: dict[str, str] | None = None) -> list[EchoedPrompt]:
    """Each prompt's echo; with `top_logprobs` (0..20 alternatives per token), its logprobs.
    A prompt the engine refuses raises the request's 400 (an `APIError`), naming it in a list."""
    ids = []
    for i, prompt in enumerate(prompts):
        try:
            ids.append(engine.encode(prompt))
        except KevError as exc:
            raise engine_error(exc, i if len(prompts) > 1 else None, fields) from None
    texts = [prompt_text(engine, p) for p in prompts]
    if top_logprobs is None:
        return [EchoedPrompt(text, len(token_ids)) for text, token_ids in zip(texts, ids)]
    try:
        answers = engine.prompt_logprobs(list(prompts), adapter, top_logprobs)
    except KevError as exc:
        raise engine_error(exc, None, fields) from None
    return [EchoedPrompt(text, len(token_ids), answer.first_token, answer.logprobs)
            for text, token_ids, answer in zip(texts, ids, answers)]


def unanswered(echoed: Sequence[EchoedPrompt], n: int, logprobs: bool) -> list[Completion]:
    """The engine's answers for ``max_tokens: 0``: nothing generated, n choices per prompt, each
    cut by its length (0) — so a response is written the same way with or without generation."""
    def empty(echo: EchoedPrompt) -> Completion:
        return Completion(text="", token_ids=[], finish_reason="length", prompt_tokens=echo.num_tokens,
                          completion_tokens=0, logprobs=[] if logprobs else None)
    return [replace(empty(e), samples=tuple(empty(e) for _ in range(n)) if n > 1 else ()) for e in echoed]
