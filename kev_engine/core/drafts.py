"""Drafts: the tokens a question is likely to write next, looked up in its own text (prompt lookup)
or written by a smaller model with the same tokenizer (`draft_model`).

Where this sits: the scheduler asks a decoding question's `Drafter` for a draft when it plans a
pass (`Scheduler.schedule`, step 4); the draft rides as extra rows of that question's segment, and
the step walks them after the pass (`Stepper._walk_drafts`): each row is sampled exactly as plain decoding
samples its token, and the walk stops at the first token that differs from the draft.

Why it changes no bit: after prefill an answer is written a token per pass, and on a CPU a pass of
a few rows is bound by reading the weights, so rows beside it are nearly free. Kev's kernels are
batch-invariant: a row's logits are the same bits whether its segment holds one new token or six
(the property chunked prefill already rests on), so the row after an accepted draft token holds
the logits plain decoding would compute in its next pass. Sampling it with the question's own
generator, penalties, grammar and stop strings gives the token plain decoding gives; tokens,
logprobs and finish reasons come out identical with speculation on and off.

How a draft is found (vLLM's `ngram` speculator, llama.cpp's lookup decoding): the question's last
n tokens, n from MAX_NGRAM down to MIN_NGRAM (the longest that matches first), looked up among its
earlier tokens, prompt and answer; the tokens after the most recent earlier occurrence are the
draft. Where that occurrence ends close to now (a repeating answer), the draft goes on repeating
it. An index per question (n-gram → the position after its latest occurrence), grown by the
tokens since the last lookup, keeps each lookup a few dict reads whatever the context's length.

A draft model's drafts (`ModelDrafter`) are written before the pass is planned, greedily, by a
second engine; they are verified the same way, so they change no bit either: only how many rows
are taken.
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Iterable, Sequence

ENV_VAR = "KEV_SPECULATIVE"
MODES = ("auto", "ngram", "model", "off")
MAX_DRAFT = 6  # a draft's most tokens: a longer one is rarely accepted whole, and each row costs
MIN_NGRAM = 2  # one token matches too often (a comma, "the") to predict what follows
MAX_NGRAM = 4


def speculative_mode(value: str | None, batch_invariant: bool, draft_model: bool = False) -> str:
    """The mode an engine runs: "ngram", "model" or "off". `value`: the setting (None:
    `KEV_SPECULATIVE`, else "auto"); `draft_model`: whether one was given. "auto" is "model" with
    a draft model, else "ngram", where the engine is batch-invariant. Drafts are refused where it
    is not: there a verified row would not be the bits of a decoded one."""
    source = "speculative"
    if value is None:
        source, value = ENV_VAR, os.environ.get(ENV_VAR) or "auto"
    if not isinstance(value, str) or value not in MODES:
        raise ValueError(f"{source}={value!r} is not allowed; use one of {list(MODES)}")
    if value == "model" and not draft_model:
        raise ValueError(f"{source}='model' needs draft_model= (a smaller model with the same tokenizer: a folder, "
                         "a .gguf file, a hub id or a Kev Engine)")
    if draft_model and value not in ("model", "auto"):
        raise ValueError(f"draft_model= was given with {source}={value!r}; a draft model drafts only with "
                         "speculative='model' (or 'auto')")
    if value == "auto":
        if not batch_invariant:
            return "off"
        return "model" if draft_model else "ngram"
    if value != "off" and not batch_invariant:
        raise ValueError(f"{source}={value!r} needs a batch-invariant engine, whose verified rows are the bits of "
                         "decoded ones (speculation then changes no token); this one is not (batch_invariant=False "
                         "was asked, or its load warned why it cannot be)")
    return value


TOKEN_BITS = 21  # an n-gram's key packs its ids, this many bits each (vocabularies are far smaller)


def _shift(k: int) -> int:
    return 3 + TOKEN_BITS * k  # 3 bits for n: n-grams of different lengths never share a key


def _key(gram: Sequence[int]) -> int:
    """An n-gram as one int: ints are no work for the garbage collector, where a tuple per token
    of every prompt made it scan the heap (a full collection stalls the pass it lands in)."""
    key = len(gram)
    for k, token in enumerate(gram):
        key |= token << _shift(k)
    return key


class Drafter:
    """One question's n-gram index over its own tokens, and how often its drafts' first token was taken."""

    def __init__(self) -> None:
        self.seen = 0  # tokens indexed so far
        self.index: dict[int, int] = {}  # n-gram (`_key`) → the position after its latest occurrence
        self.tried = 0  # drafts verified for this question
        self.taken = 0  # of those, the ones whose first token its answer took
        self.taken_tokens = 0  # draft tokens its answer took, in all

    def propose(self, ids: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens likely to follow `ids` (empty: no n-gram of its end occurred before)."""
        self._grow(ids)
        end = len(ids)
        for n in range(min(MAX_NGRAM, end - 1), MIN_NGRAM - 1, -1):
            at = self.index.get(_key(ids[end - n :]))
            if at is not None:
                # ids[at] follows the earlier occurrence; past the end, the draft repeats its own start
                draft: list[int] = []
                for source in range(at, at + limit):
                    draft.append(ids[source] if source < end else draft[source - end])
                return draft
        return []

    def _grow(self, ids: Sequence[int]) -> None:
        """Index the n-grams that end before each token added since the last lookup: n-gram
        ids[p-n:p] is followed by ids[p], later positions replacing earlier ones. The question's
        own end is never its own match. Built by maps over shifted slices: a prompt of thousands
        of tokens is indexed in C, not token by token."""
        end = len(ids)
        for n in range(MIN_NGRAM, MAX_NGRAM + 1):
            start = max(self.seen, n)
            if start < end:
                keys: Iterable[int] = itertools.repeat(n, end - start)
                for k in range(n):
                    shifted = map(operator.lshift, ids[start - n + k : end - n + k], itertools.repeat(_shift(k)))
                    keys = map(operator.or_, keys, shifted)
                self.index.update(zip(keys, range(start, end)))
        self.seen = end


class ModelDrafter(Drafter):
    """One question's drafts from a draft model: written before a pass is planned (`DraftModel.prepare`),
    for the tokens the question had then; proposed only while it still has exactly those."""

    def __init__(self) -> None:
        super().__init__()
        self.ready: tuple[int, list[int]] = (-1, [])  # (its token count when drafted, the draft)

    def propose(self, ids: Sequence[int], limit: int) -> list[int]:
        length, draft = self.ready
        return draft[:limit] if length == len(ids) else []


class Acceptance:
    """How often drafts are taken, engine-wide by depth, for pricing their rows (`Scheduler._drafts`).

    A draft token is taken only if every one before it was, and a draft's first tokens are taken far
    more often than its later ones (an answer that paraphrases its context copies a word or two,
    then goes its own way): the chance of depth d is the chance of depth 1 times the rate at which
    each deeper token was taken once the one before it was. Depth 1 is the question's own record,
    drawn toward the engine's (an answer that copies keeps copying); every rate starts at 1 in 2."""

    def __init__(self) -> None:
        self.tried = [0] * (MAX_DRAFT + 1)  # [d]: drafts whose token at depth d was checked
        self.taken = [0] * (MAX_DRAFT + 1)  # [d]: of those, taken

    def rate(self, depth: int) -> float:
        return (self.taken[depth] + 1) / (self.tried[depth] + 2)

    def chances(self, drafter: Drafter, length: int) -> list[float]:
        """The chance that each of a `length`-token draft's tokens is taken, depth 1 first."""
        first = (drafter.taken + 2 * self.rate(1)) / (drafter.tried + 2)
        out = [first]
        for depth in range(2, length + 1):
            out.append(out[-1] * self.rate(depth))
        return out

    def record(self, drafter: Drafter, length: int, taken: int) -> None:
        """A `length`-token draft of `drafter`'s question whose first `taken` tokens its answer took."""
        for depth in range(1, min(taken + 1, length) + 1):
            self.tried[depth] += 1
            self.taken[depth] += depth <= taken
        drafter.tried += 1
        drafter.taken += taken > 0
        drafter.taken_tokens += taken
