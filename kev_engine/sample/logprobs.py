"""Logprobs: each generated token's log-probability, and the most likely alternatives.

Where this sits: `sample.draw_tokens` calls `compute` on the rows that asked for logprobs, with the
logits the token was drawn from — after penalties, logit_bias and the constraint's mask, divided
by the row's temperature (greedy rows: by 1) — and before top-k / top-p / min-p truncation. That
is the distribution OpenAI's `logprobs` describe: the truncation only decides which tokens may be
drawn, and reporting after it would renormalise the kept ones and turn every alternative it cut
into -inf. Tokens the constraint forbids (-inf) are never listed as alternatives.

Isolation: `log_softmax` and `topk` along the vocabulary work row by row, and every row takes
`MAX_TOP_LOGPROBS` alternatives whatever it asked for (then keeps its own k): which of two tied
tokens comes first then depends on the row alone, never on another row's k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..inputs.params import GREEDY_BELOW, MAX_TOP_LOGPROBS
from ..results import Logprob, TokenLogprob


class TokenTexts:
    """Token id → its text, decoded once per id: a decode step reports up to 21 tokens per row,
    and decoding each again every step would cost more than the sampling does."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def compute(
    logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor, top_k: Sequence[int], texts: TokenTexts
) -> list[TokenLogprob]:
    """One `TokenLogprob` per row. logits [L, V] fp32 (penalised, masked); temperature [L] (0 =
    greedy, as is anything under GREEDY_BELOW: divided by 1); tokens [L] drawn; top_k: the
    alternatives each row wants, 0..20."""
    scale = torch.where(temperature >= GREEDY_BELOW, temperature, torch.ones_like(temperature))
    logprobs = (logits / scale[:, None]).log_softmax(dim=-1)  # [L, V]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    top_ids: list[list[int]] = [[] for _ in top_k]
    top_values: list[list[float]] = [[] for _ in top_k]
    if any(top_k):
        values, ids = logprobs.topk(min(MAX_TOP_LOGPROBS, logprobs.shape[-1]), dim=-1)  # [L, 20] each
        top_ids, top_values = ids.tolist(), values.tolist()
    token_ids = tokens.tolist()
    out = []
    for row, k in enumerate(top_k):
        top = tuple(Logprob(t, texts(t), v) for t, v in zip(top_ids[row][:k], top_values[row][:k])
                    if v != -math.inf)
        out.append(TokenLogprob(token_ids[row], texts(token_ids[row]), chosen[row], top))
    return out


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt's tokens with their logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo`): the
    first token has none (nothing precedes it), each later one its log-probability given the
    tokens before it, under the model's own distribution (no penalty, bias, constraint or
    temperature applies to a prompt)."""

    first_token: str
    logprobs: list[TokenLogprob]  # tokens 1.. of the prompt


def prompt(rows: torch.Tensor, ids: Sequence[int], top_k: int, texts: TokenTexts) -> PromptLogprobs:
    """`PromptLogprobs` from a prompt's logits (rows [len, vocab]: row t is the distribution of
    token t + 1, the last row that of the token after the prompt), each with `top_k` alternatives."""
    assert rows.shape[0] == len(ids), (rows.shape, len(ids))
    if len(ids) == 1:
        return PromptLogprobs(texts(ids[0]), [])
    following = torch.tensor(list(ids[1:]), device=rows.device)  # [len - 1]
    greedy = torch.zeros(len(ids) - 1, device=rows.device)  # temperature 0: the logits as they are
    return PromptLogprobs(texts(ids[0]), compute(rows[:-1], greedy, following, [top_k] * (len(ids) - 1), texts))
