"""What the LlamaIndex examples print about the engine's work: LLM calls and the passes they took."""

from __future__ import annotations


def passes(engine, before: dict[str, int]) -> str:
    after = engine.stats()
    used = {k: after[k] - before[k] for k in ("requests", "prefill_passes", "decode_steps", "forward_passes")}
    # every pass is one or the other: prefill_passes (prompt tokens, decode rows maybe beside them) or decode_steps
    return (f"{used['requests']} LLM calls in {used['forward_passes']} forward passes ({used['prefill_passes']} "
            f"with prompt tokens, {used['decode_steps']} of decode rows alone)")
