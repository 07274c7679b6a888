"""Sample: one next token per question from the logits at its segment end.

Settings arrive as per-row tensors so mixed temperatures / top_p / top_k share one call.
Rows at temperature 0 — or below `GREEDY_BELOW` (1e-5), where logits / temperature would
overflow to NaN — take the argmax, and so does any row whose probabilities still come out
non-finite (a model emitting inf/NaN logits): no row ever draws from NaN. Randomness is drawn
per row from that question's own `torch.Generator` (seeded requests) — so a seeded question
samples the same tokens whatever it is packed with — or from the engine's generator
(unseeded ones).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .params import GREEDY_BELOW


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k and top-p exclude. logits [N, V]; top_k [N] (0 = off); top_p [N]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]  # [N, 1]
    drop = ranks >= k
    probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False  # never drop the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """logits [N, V] fp32; temperature/top_p [N] float; top_k [N] long → token ids [N]."""
    greedy = logits.argmax(dim=-1)  # [N]
    random_rows = (temperature >= GREEDY_BELOW).nonzero().flatten().tolist()
    if not random_rows:
        return greedy
    rows = torch.tensor(random_rows, device=logits.device)
    scaled = logits[rows] / temperature[rows, None]
    needs_filter = (top_k[rows] > 0) | (top_p[rows] < 1)
    if bool(needs_filter.any()):
        scaled = apply_top_k_top_p(scaled, top_k[rows], top_p[rows])
    probs = scaled.softmax(dim=-1)  # [R, V]
    finite = torch.isfinite(probs).all(dim=-1)  # [R]; a non-finite row keeps its argmax (no sync here)
    tokens = greedy.clone()
    for j, row in enumerate(random_rows):
        # exponential race: argmax(p / E), E ~ Exp(1), is a draw from p; one generator per row
        noise = torch.empty_like(probs[j]).exponential_(1.0, generator=generators[row])
        tokens[row] = torch.where(finite[j], (probs[j] / noise).argmax(), greedy[row])
    return tokens
