"""Several LoRA adapters and the base model in one packed pass.

Six questions, each routed to the `shout` adapter, the `json` adapter or the plain base model,
go to ONE `engine.generate` call: one packed prefill, then shared decode steps. Each adapter's
LoRA update runs only on the tokens of its own questions; base-model questions pay nothing.

    python examples/train_adapters.py     # once: writes examples/adapters/{shout,json}
    python examples/mixed_adapters.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kev_engine import Engine, SamplingParams

ADAPTERS = Path(__file__).parent / "adapters"
NAMES = ["shout", "json"]
QUESTIONS = [  # (question, adapter name or None for the base model); none of them was trained on
    ("What is the capital of Germany?", "shout"),
    ("What is the capital of Germany?", "json"),
    ("What is the capital of Germany?", None),
    ("How many hours are in a day?", "json"),
    ("Who invented the telephone?", "shout"),
    ("What do caterpillars turn into?", None),
]


def main() -> None:
    missing = [name for name in NAMES if not (ADAPTERS / name / "adapter_config.json").is_file()]
    if missing:
        print(f"adapter(s) {missing} not found in {ADAPTERS}; train them first (a few minutes on CPU):\n"
              "    python examples/train_adapters.py", file=sys.stderr)
        sys.exit(1)
    engine = Engine.from_pretrained(adapters={name: str(ADAPTERS / name) for name in NAMES})
    prompts = [[{"role": "user", "content": question}] for question, _ in QUESTIONS]
    adapters = [adapter for _, adapter in QUESTIONS]
    start = time.perf_counter()
    answers = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=48), adapters=adapters)
    elapsed = time.perf_counter() - start
    for (question, _), answer in zip(QUESTIONS, answers):
        print(f"[{answer.adapter or 'base'}] {question}\n    -> {answer.text.strip()}  ({answer.finish_reason})")
    stats = engine.stats()
    print(f"\n{len(prompts)} questions, adapters {engine.adapters} + base, in {elapsed:.1f} s")
    print(f"engine.stats(): {stats}")
    engine.close()


if __name__ == "__main__":
    main()
