"""RAG workload used by the benchmarks: 16 questions, each with its own passage.

The passages in ``examples/data/rag.jsonl`` are spread between about 70 and
450 SmolLM2 tokens, so a packed batch mixes short and long prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "examples" / "data" / "rag.jsonl"
SYSTEM_PROMPT = "Answer the question using only the context. Be brief."


def load_rag(path: str | Path | None = None) -> list[dict]:
    """Read the JSONL workload; each item has ``id``, ``question`` and ``context``."""
    with open(path or DEFAULT_PATH, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def rag_messages(item: dict) -> list[dict]:
    """Turn one workload item into chat messages (system + user)."""
    user = f"Context:\n{item['context']}\n\nQuestion: {item['question']}"
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user},
    ]
