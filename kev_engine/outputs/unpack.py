"""Unpack: a sampled token back onto its question — text, stop strings, finish reason.

Results reach callers through each request's own future, so the caller's order is kept
whatever order the scheduler packed them in.
"""

from __future__ import annotations

from collections.abc import Collection

from ..core.request import Request
from .detokenize import Detokenizer


def _find_stop(text: str, stops: tuple[str, ...], search_from: int) -> int:
    """Earliest index of any stop string at or after `search_from`, or -1."""
    hits = [i for i in (text.find(s, search_from) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def text_delta(request: Request) -> str:
    """Text that is safe to stream now, and mark it streamed.

    Until the request finishes, hold back what could still turn out to be the start of a stop
    string (it would be cut from the final text) and a trailing partial UTF-8 character.
    """
    text = request.text
    end = len(text)
    if request.finish_reason is None:
        if request.sampling.stop:
            end -= max(len(s) for s in request.sampling.stop) - 1
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
    if end <= request.streamed:
        return ""
    delta, request.streamed = text[request.streamed : end], end
    return delta


def _ends(request: Request, token: int, eos_ids: Collection[int]) -> bool:
    """Whether `token` ends the answer as end-of-sequence: one of the model's (unless ignore_eos —
    a constrained answer still ends once its grammar is complete) or of the request's stop_token_ids."""
    sampling = request.sampling
    if token in sampling.stop_token_ids:
        return True
    if token not in eos_ids:
        return False
    return not sampling.ignore_eos or (request.matcher is not None and request.matcher.is_terminated())


def append_token(request: Request, token: int, eos_ids: Collection[int], detokenizer: Detokenizer) -> bool:
    """Record one generated token; return True when the request is finished.

    Before `min_tokens` tokens nothing but the length ends it: the sampler bans the end tokens
    until then, and stop strings are looked for only from there on (vLLM's rule)."""
    request.output_ids.append(token)
    if _ends(request, token, eos_ids):  # kept in token_ids (it was generated), left out of the text
        request.text = detokenizer.text(request, len(request.output_ids) - 1)
        request.finish_reason = "stop"
        return True
    previous = request.text
    text = detokenizer.text(request)
    stops = request.sampling.stop
    if stops and len(request.output_ids) >= request.sampling.min_tokens:
        # a stop string may straddle tokens: search from just before the new text
        longest = max(len(s) for s in stops)
        cut = _find_stop(text, stops, max(0, len(previous) - longest))
        if cut >= 0:
            request.text = text[:cut]
            request.finish_reason = "stop"
            return True
    request.text = text
    if len(request.output_ids) >= request.sampling.max_tokens or request.num_tokens >= request.max_total:
        request.finish_reason = "length"
        return True
    return False
