"""`kev verify`: a user's own isolation check on their own model, prompts and adapters.

Beside the flow, not part of it: the prompts are answered greedily in ONE packed call (sharing
whatever prefixes they share), then each alone (a private `cache_salt`, so it shares nothing),
and the logits every generated token was sampled from are compared. Packed must equal solo:
greedy tokens identical, and logits bitwise equal (what a batch-invariant engine promises) or
within the dtype's rounding tolerance. Each row names the comparison asked (`compare`) apart from
its outcomes (`tokens_match`, `logits_match`, `ok`): the mode never reads as a result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..inputs.params import SamplingParams

FP32_ATOL = 1e-4
HALF_ULPS = 4  # bf16/fp16: this many units in the last place of the largest logit
BITWISE, WITHIN_ROUNDING = "bitwise", "within rounding"  # a row's `compare`: the comparison asked


def tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:
    """What "equal" means for logits computed in `dtype` (summation order differs between packs)."""
    if dtype == torch.float32:
        return FP32_ATOL
    return HALF_ULPS * torch.finfo(dtype).eps * float(logits.abs().max())


def verify(
    engine: Any, prompts: Sequence[Any], adapters: Sequence[str | None], max_tokens: int, bitwise: bool | None = None
) -> list[dict]:
    """One row per prompt: shared prefix tokens, the comparison asked (`compare`), and its outcomes:
    greedy tokens match, max logit difference, logits match, ok (both match).

    `bitwise` (None: the engine's `batch_invariant`): logits match only when bitwise equal
    (`torch.equal`); otherwise a difference within the dtype's tolerance matches.
    """
    if bitwise is None:
        bitwise = bool(getattr(engine, "batch_invariant", False))
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    packed = _run(engine, list(prompts), [greedy] * len(prompts), list(adapters))
    dtype = next(engine.model.parameters()).dtype
    rows = []
    for i, (prompt, adapter, (completion, logits)) in enumerate(zip(prompts, adapters, packed)):
        alone = SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=f"kev-verify-alone-{i}")
        solo_completion, solo_logits = _run(engine, [prompt], [alone], [adapter])[0]
        steps = min(len(logits), len(solo_logits))
        same = 0
        while same < steps and completion.token_ids[same] == solo_completion.token_ids[same]:
            same += 1
        compared = max(1, same)  # after the first different token the contexts differ: stop comparing there
        diff = float((logits[:compared] - solo_logits[:compared]).abs().max())
        tokens_match = completion.token_ids == solo_completion.token_ids
        if bitwise:
            logits_match = len(logits) == len(solo_logits) and torch.equal(logits, solo_logits)
        else:
            logits_match = diff <= tolerance(dtype, solo_logits)
        rows.append({
            "adapter": adapter or "base", "prompt_tokens": completion.prompt_tokens,
            "shared_prefix_tokens": completion.cached_tokens, "tokens": len(completion.token_ids),
            "compare": BITWISE if bitwise else WITHIN_ROUNDING,
            "tokens_match": tokens_match, "max_logit_diff": diff, "logits_match": logits_match,
            "ok": tokens_match and logits_match,
        })
    return rows


def _run(engine: Any, prompts: list[Any], samplings: list[SamplingParams], adapters: list[str | None]) -> list:
    """(Completion, [tokens, vocab] logits) per prompt, all in one packed call."""
    return engine.generate_with_logits(prompts, samplings, adapters)
