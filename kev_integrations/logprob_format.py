"""Engine logprobs → OpenAI's two wire shapes, written once for every front end.

Chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` is what `kev serve` returns on
/v1/chat/completions and what ChatKev puts in ``response_metadata["logprobs"]`` (ChatOpenAI's
shape, so code reading one reads the other); completions' ``{tokens, token_logprobs,
top_logprobs, text_offset}`` is /v1/completions' and KevLLM's ``generation_info["logprobs"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kev_engine import TokenLogprob


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
    """Chat's logprobs object for `entries` (None when the request did not ask for logprobs)."""
    if entries is None:
        return None
    return {"content": [{**_entry(e.token, e.logprob), "top_logprobs": [_entry(a.token, a.logprob)
                                                                         for a in e.top_logprobs]}
                        for e in entries], "refusal": None}


def text_logprobs(entries: Sequence[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """Completions' logprobs object; `text_offset` counts characters from `offset` (where the
    entries' text starts in the choice). A token left out of the text (end of sequence) still
    has its entry, at the offset where the text ends."""
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{a.token: a.logprob for a in e.top_logprobs} for e in entries],
            "text_offset": offsets}


def echoed_text_logprobs(first_token: str, prompt: Sequence[TokenLogprob],
                         answer: dict[str, Any] | None) -> dict[str, Any]:
    """Completions' logprobs object of an echoed prompt followed by its `answer`'s (from
    `text_logprobs`, offsets counted from where the prompt's text ends). The prompt's first
    token has no logprob, nothing coming before it: null in `token_logprobs` and `top_logprobs`,
    as OpenAI and vLLM write it."""
    rest = text_logprobs(prompt, len(first_token))
    assert rest is not None
    parts = [{"tokens": [first_token], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}, rest]
    if answer is not None:
        parts.append(answer)
    return {key: [value for part in parts for value in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
