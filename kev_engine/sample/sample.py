"""Sample: one next token per question from the logits at its segment end.

`draw_tokens` is the whole per-request step the engine calls after a pass: each row penalised by
its own tokens (`penalties`), masked to what its grammar allows, drawn (`sample`, below), given
its logprobs if it asked (`logprobs`); a constrained request's matcher accepts the token drawn,
and a grammar that allows nothing fails its own request only.

Settings arrive as per-row tensors so mixed temperatures / min_p / top_p / top_k share one call.
The logits arrive penalised and masked (`penalties`, then the constraint's grammar); random rows
are divided by their temperature, cut by min_p (vLLM's order: before top-k / top-p), then by
top-k and top-p, and drawn. Every step works row by row (no reduction crosses rows), and a row
whose settings disable a filter passes through it unchanged, so a row's draw never depends on
which filters its pack mates asked for.
Rows at temperature 0 — or below `GREEDY_BELOW` (1e-5), where logits / temperature would
overflow to NaN — take the argmax, and so does any row whose probabilities still come out
non-finite (a model emitting inf/NaN logits): no row ever draws from NaN. Randomness is drawn
per row from that question's own `torch.Generator` (seeded requests) — so a seeded question
samples the same tokens whatever it is packed with — or from torch's default generator, shared
by the process (unseeded ones: their tokens depend on what else drew before them).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch

from ..core.request import Request
from ..errors import ConstraintError
from ..inputs.params import GREEDY_BELOW
from ..results import TokenLogprob
from . import penalties
from .grammar import Grammars, mask_logits
from .logprobs import TokenTexts
from .logprobs import compute as compute_logprobs


class Draw(NamedTuple):
    """What one sampled row gave its request: a token (or the error that ends it) and, when asked
    for, its logprobs; `row` is its row of the pass's logits."""

    request: Request
    row: int
    token: int | BaseException
    logprob: TokenLogprob | None


def draw_tokens(plan: Sequence[tuple[Request, int]], logits: torch.Tensor, eos_ids: Collection[int],
                vocab_size: int, token_texts: TokenTexts) -> list[Draw]:
    """One token for each (request, row of `logits`) of `plan`; several requests may share a row
    (an n > 1 request's samples at their first token)."""
    requests = [request for request, _ in plan]
    settings = [r.sampling for r in requests]
    device = logits.device
    rows = [row for _, row in plan]
    penalized = penalties.build(requests, logits.shape[-1], eos_ids, device)
    matchers = [r.matcher for r in requests]
    if penalized is None and all(m is None for m in matchers) and rows == list(range(len(logits))):
        selected = logits  # nothing writes to it: no copy (a decode step's rows are the pass's, in order)
    else:
        selected = logits[rows]  # [R, vocab], a copy: penalising and masking it leave captured logits raw
    penalties.apply(selected, penalized)
    dead = set(mask_logits(selected, matchers, vocab_size))
    temperature = torch.tensor([s.temperature for s in settings], dtype=torch.float32, device=device)
    drawn = sample(
        selected,
        temperature=temperature,
        top_p=torch.tensor([s.top_p for s in settings], dtype=torch.float32, device=device),
        top_k=torch.tensor([s.top_k for s in settings], dtype=torch.long, device=device),
        generators=[r.generator for r in requests],
        min_p=torch.tensor([s.min_p for s in settings], dtype=torch.float32, device=device)
        if any(s.min_p for s in settings) else None,
    )  # [R]
    asked = [i for i, s in enumerate(settings) if s.logprobs]
    every = len(asked) == len(settings)  # then no [R, vocab] copy of the rows that asked
    logprobs: dict[int, TokenLogprob] = dict(zip(asked, compute_logprobs(
        selected if every else selected[asked], temperature if every else temperature[asked],
        drawn if every else drawn[asked], [settings[i].top_logprobs for i in asked],
        token_texts))) if asked else {}
    draws = []
    for i, ((request, row), token) in enumerate(zip(plan, drawn.tolist())):
        outcome: int | BaseException = token
        if request.matcher is not None and (i in dead or not request.matcher.accept_token(token)):
            kind = request.sampling.constraint[0] if request.sampling.constraint else "constraint"
            early = len(request.output_ids) < settings[i].min_tokens
            short = " (min_tokens bans ending before then)" if early else ""
            outcome = ConstraintError(
                f"the {kind} constraint allows no further token after {len(request.output_ids)} generated "
                f"tokens{short} ({request.text[-80:]!r}); it cannot be satisfied from here"
            )
        draws.append(Draw(request, row, outcome, logprobs.get(i)))
    return draws


class Sampler:
    """The sample stage: draws each planned row's token (`draw_tokens`) and owns the per-request
    state drawing needs — a seeded request's generator and a constrained one's grammar matcher,
    each made at its first draw and kept through preemption (its draws go on where they were)."""

    def __init__(self, grammars: Grammars, eos_ids: Collection[int], token_texts: TokenTexts) -> None:
        self.grammars = grammars
        self.eos_ids = eos_ids
        self.token_texts = token_texts

    def sample(self, plan: Sequence[tuple[Request, int]], logits: torch.Tensor) -> list[Draw]:
        """One token per (request, row of `logits`) of `plan`."""
        if not plan:
            return []
        for request, _ in plan:
            if request.sampling.seed is not None and request.generator is None:
                request.generator = torch.Generator(device=logits.device).manual_seed(request.sampling.seed)
            if request.grammar is not None and request.matcher is None:
                request.matcher = self.grammars.matcher(request.grammar)
        return draw_tokens(plan, logits, self.eos_ids, self.grammars.vocab_size, self.token_texts)


def draws_alone(request: Request) -> bool:
    """Whether each of the request's rows draws the same token whatever was drawn before it
    (speculation draws a draft's rows in one call then): greedy, no grammar, no penalty over its
    own tokens (`penalties.reads_history`)."""
    return (request.sampling.temperature < GREEDY_BELOW and request.grammar is None
            and not penalties.reads_history(request))


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
    # top_p = 1 keeps everything: a rounded cumsum may reach 1.0 before the tail, and must not cut it
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False  # never drop the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf tokens less likely than min_p x the top token. logits [N, V]; min_p [N] (0 = off).

    Compared as probabilities (softmax along each row, one product per row) rather than as
    logits against max + log(min_p): a log of the [N] settings would be computed by torch's
    vector or scalar loop depending on N, and so differ in the last bit between packs."""
    probs = logits.softmax(dim=-1)  # [N, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [N, V] fp32; temperature/top_p/min_p [N] float; top_k [N] long → token ids [N]."""
    # [N]: each row's first largest logit, the index argmax gives (ties, NaN and all); torch's max along
    # a row finds it several times faster than argmax on CPU, every decode step
    greedy = logits.max(dim=-1).indices
    random_rows = (temperature >= GREEDY_BELOW).nonzero().flatten().tolist()
    if not random_rows:
        return greedy
    rows = torch.tensor(random_rows, device=logits.device)
    scaled = logits[rows] / temperature[rows, None]
    if min_p is not None and bool((min_p[rows] > 0).any()):
        scaled = apply_min_p(scaled, min_p[rows])
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
