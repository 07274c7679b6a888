"""What a caller gets back: a `Completion` per answer, `TextPiece`s while it streams, and the
logprobs of their tokens.

Plain values, free of engine state, so they cross threads, processes (`kev serve` rebuilds them
from JSON with `Completion.from_dict`) and the integrations' public surface unchanged. Every
stage may import them (as `errors`): the scheduler's requests hold them, the sampler makes
logprobs, the outputs processor builds completions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Logprob:
    """One token and its log-probability (natural log)."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and, when asked for, the top alternatives at its step
    (most likely first; the chosen token is among them when it ranks that high)."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: tuple[Logprob, ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenLogprob:
        """Rebuild from `dataclasses.asdict` output (JSON from `kev serve`)."""
        top = tuple(Logprob(**alt) for alt in data.get("top_logprobs", ()))
        return cls(data["token_id"], data["token"], data["logprob"], top)


@dataclass(frozen=True)
class Completion:
    """One answer, in the caller's order."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    adapter: str | None = None
    settings_version: int = 0
    """The engine-defaults version this request was resolved under."""
    cached_tokens: int = 0
    """Prompt tokens whose KV was reused from a shared prefix instead of computed."""
    logprobs: list[TokenLogprob] | None = None
    """With ``logprobs=True``: one per entry of `token_ids`, in order (see `logprobs` for which
    distribution they describe)."""
    samples: tuple[Completion, ...] = ()
    """With ``n`` > 1: every sample of the prompt, in order (this Completion is samples[0]'s answer;
    each sample's own `samples` is empty). Empty when n = 1."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Completion:
        """Rebuild from `dataclasses.asdict` output (JSON from `kev serve`); unknown keys are refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Completion field(s) {unknown}; known: {sorted(known)}")
        values = dict(data)
        if values.get("logprobs") is not None:
            values["logprobs"] = [TokenLogprob.from_dict(item) for item in values["logprobs"]]
        values["samples"] = tuple(cls.from_dict(sample) for sample in values.get("samples", ()))
        return cls(**values)


class TextPiece(str):
    """What `on_text` receives: a str (the new text), plus `sample_index` — which of the prompt's
    n samples it belongs to (0 when n = 1; not `index`, which is str's method) — and `logprobs`:
    those of the tokens generated since the previous piece (None unless the request asked for
    logprobs). Text is held back while it may still be a stop string or a partial character, so
    a piece's tokens need not spell exactly its text; over the whole stream every token whose
    text streamed is reported once, in order, and the `Completion` has them all (an
    end-of-sequence token, which adds no text, only there)."""

    sample_index: int
    logprobs: list[TokenLogprob] | None

    def __new__(cls, text: str, sample_index: int = 0, logprobs: list[TokenLogprob] | None = None) -> TextPiece:
        piece = super().__new__(cls, text)
        piece.sample_index, piece.logprobs = sample_index, logprobs
        return piece
