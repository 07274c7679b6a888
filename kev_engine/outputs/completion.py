"""What a caller gets back: a `Completion` per answer, and `TextPiece`s while it streams.

Plain values, free of engine state, so they cross threads, processes (`kev serve` rebuilds them
from JSON with `Completion.from_dict`) and the integrations' public surface unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from ..sample.logprobs import TokenLogprob

FinishReason = Literal["stop", "length"]


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
