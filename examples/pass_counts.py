"""What the LlamaIndex examples print about the engine's work: LLM calls and the passes they took."""

from __future__ import annotations


def passes(engine, before: dict[str, int]) -> str:
    after = engine.stats()
    used = {k: after[k] - before[k] for k in ("requests", "prefill_passes", "decode_steps", "forward_passes")}
    return (f"{used['requests']} LLM calls in {used['prefill_passes']} prefill pass(es) + "
            f"{used['decode_steps']} decode steps = {used['forward_passes']} forward passes")
