"""Penalties and biases: each row's logits adjusted by its own request's tokens and settings.

Where this sits: `sample.draw_tokens` builds `Penalties` for the rows it samples, applies them, then
the constraint's mask (so no bias can bring back a token the grammar forbids), then `sample`.
The order is vLLM's: `logit_bias` and `min_tokens`' ban on ending, then `repetition_penalty`
(transformers' semantics, over the prompt and the answer so far), then `presence_penalty` and
`frequency_penalty` (OpenAI's, over the answer so far).

The work is sparse: only the (row, token) entries a row's own tokens or bias name are read,
changed by one elementwise operation and written back, so a pass pays for the tokens its
penalised rows hold, not for rows x vocabulary. Isolation: a row reads only its own tokens and
settings, and each entry is computed by one + - * or / — the same bits in torch's vector and
scalar loops, wherever the entry falls — so a row's logits do not depend on what else is packed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..inputs.params import SamplingParams


class Penalized(Protocol):
    """What penalties read from a request (`request.Request` has it)."""

    sampling: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    prompt_set: torch.Tensor | None


@dataclass
class Penalties:
    """One pass's penalties as flat indices into logits [R, V] viewed as [R * V]."""

    bias_index: torch.Tensor  # [B] long
    bias: torch.Tensor  # [B] fp32
    ban_index: torch.Tensor  # [E] long: end tokens of rows still short of min_tokens
    seen_index: torch.Tensor  # [S] long: tokens in a repetition-penalised row's prompt or answer
    seen_penalty: torch.Tensor  # [S] fp32: that row's repetition_penalty
    count_index: torch.Tensor  # [C] long: tokens in a presence/frequency-penalised row's answer
    count_penalty: torch.Tensor  # [C] fp32: frequency_penalty * count + presence_penalty


def prompt_set(request: Penalized, device: torch.device) -> torch.Tensor:
    """The distinct ids of the request's prompt, computed once per request (prompts are long)."""
    if request.prompt_set is None:
        request.prompt_set = torch.tensor(sorted(set(request.prompt_ids)), dtype=torch.long, device=device)
    return request.prompt_set


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def reads_history(request: Penalized) -> bool:
    """Whether the request's penalties depend on the tokens it has drawn so far: a repetition,
    presence or frequency penalty, or min_tokens' ban on ending not yet lifted (logit_bias does not)."""
    s = request.sampling
    return (s.repetition_penalty != 1.0 or bool(s.presence_penalty or s.frequency_penalty)
            or len(request.output_ids) < s.min_tokens)


def build(rows: Sequence[Penalized], vocab: int, end_ids: Collection[int], device: torch.device) -> Penalties | None:
    """The penalties of `rows` (row i of the logits is rows[i]), or None when no row has any.

    `end_ids`: the model's end-of-sequence ids, banned (with each row's stop_token_ids; without
    them under ignore_eos, where they end nothing) while a row has fewer than its min_tokens.
    Token ids are the engine's to check against the vocabulary (`intake.Intake`)."""
    if not any(r.sampling.penalized for r in rows):
        return None
    bias_index: list[int] = []
    bias: list[float] = []
    ban: list[int] = []
    seen_parts: list[torch.Tensor] = []
    counted: list[int] = []
    for i, request in enumerate(rows):
        s, base = request.sampling, i * vocab
        for token, value in s.logit_bias:
            bias_index.append(base + token)
            bias.append(value)
        if len(request.output_ids) < s.min_tokens:
            ends = {*s.stop_token_ids} if s.ignore_eos else {*end_ids, *s.stop_token_ids}
            ban.extend(base + t for t in ends)
        if s.repetition_penalty != 1.0:
            seen_parts += [prompt_set(request, device) + base, _long([base + t for t in request.output_ids], device)]
        if (s.presence_penalty or s.frequency_penalty) and request.output_ids:
            counted.extend(base + t for t in request.output_ids)
    empty = torch.empty(0, dtype=torch.long, device=device)
    seen_index = torch.cat(seen_parts).unique() if seen_parts else empty  # a token seen twice is penalised once
    count_index, counts = _long(counted, device).unique(return_counts=True) if counted else (empty, empty)
    settings = [r.sampling for r in rows]
    repetition = torch.tensor([s.repetition_penalty for s in settings], dtype=torch.float32, device=device)
    presence = torch.tensor([s.presence_penalty for s in settings], dtype=torch.float32, device=device)
    frequency = torch.tensor([s.frequency_penalty for s in settings], dtype=torch.float32, device=device)
    count_row = count_index // vocab
    return Penalties(
        bias_index=_long(bias_index, device),
        bias=torch.tensor(bias, dtype=torch.float32, device=device),
        ban_index=_long(ban, device),
        seen_index=seen_index,
        seen_penalty=repetition[seen_index // vocab],
        count_index=count_index,
        count_penalty=counts.float() * frequency[count_row] + presence[count_row],
    )


def apply(logits: torch.Tensor, penalties: Penalties | None) -> None:
    """Adjust logits [R, V] (contiguous, fp32) in place."""
    if penalties is None:
        return
    flat = logits.view(-1)  # [R * V]
    p = penalties
    if len(p.bias_index):
        flat[p.bias_index] = flat[p.bias_index] + p.bias
    if len(p.ban_index):
        flat[p.ban_index] = float("-inf")
    if len(p.seen_index):
        seen = flat[p.seen_index]
        flat[p.seen_index] = torch.where(seen < 0, seen * p.seen_penalty, seen / p.seen_penalty)
    if len(p.count_index):
        flat[p.count_index] = flat[p.count_index] - p.count_penalty
