"""DOC-QA: 20 questions about ONE ~1,400-token document — Kev computes the document once.

Same harness as bench_engine.py (every system in its own process, same prompt ids, greedy,
answers compared token for token with transformers one at a time), on a workload whose
questions share a long prefix: a system prompt and the document, then each question.

* ``kev``       - one ``Engine.generate`` call: the document's KV blocks are computed by the first
                  question and read by the other 19 in the same pass (a fresh ``cache_salt`` per
                  timed run, so no run reuses an earlier one's blocks).
* ``hf_serial`` - transformers ``generate`` per question (every prompt fully prefilled).
* ``hf_padded`` - transformers ``generate`` on one left-padded batch of 20.
* ``llamacpp``  - llama-cpp-python per question WITHOUT reset: it reuses the previous prompt's
                  common prefix KV, as llama.cpp's server does (skipped when not installed).

Usage: python benchmarks/bench_prefix.py [--max-tokens 32] [--repeat 1] [--only NAME] [--skip NAME ...]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import compare, parse_args, worker
from workload import SYSTEM_PROMPT, load_rag

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_prefix.md"
DOC_ITEMS = 6  # rag.jsonl passages joined into one document of about 1,400 tokens
EXTRA_QUESTIONS = [
    "Summarize the document in one sentence.",
    "Which place is mentioned first in the document?",
    "List three numbers that appear in the document.",
    "What is the main topic of the second paragraph?",
    "Which person is named in the document?",
    "What year appears in the document?",
    "Give the document a short title.",
    "What is described in the last paragraph?",
    "Which paragraph is the longest?",
    "Name one organisation mentioned in the document.",
    "What is the oldest date in the document?",
    "Does the document mention a country? Which one?",
    "What could a good follow-up question be?",
    "Which fact in the document is the most surprising?",
]


def doc_qa_messages(num_questions: int = 20) -> list[list[dict]]:
    items = load_rag()
    document = "\n\n".join(item["context"] for item in items[:DOC_ITEMS])
    questions = [item["question"] for item in items[:DOC_ITEMS]]
    questions = (questions + EXTRA_QUESTIONS)[:num_questions]
    return [[{"role": "system", "content": SYSTEM_PROMPT},
             {"role": "user", "content": f"Context:\n{document}\n\nQuestion: {q}"}] for q in questions]


def main() -> None:
    args = parse_args(__doc__, default_max_tokens=32)
    if args.worker:
        return worker(*args.worker)
    compare(doc_qa_messages(), args, "bench_prefix (DOC-QA)", RESULTS_MD, reuse_prefix=True)


if __name__ == "__main__":
    main()
