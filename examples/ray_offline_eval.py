"""Offline evaluation with Ray Data: the 16 RAG questions through KevPredictor actors.

Each actor loads the embedded SmolLM2-135M-Instruct once; every batch of rows it gets is one
packed `Engine.generate` call. The answers are written to a JSONL as they arrive, with progress
and throughput. `examples/data/rag.jsonl` holds questions and passages but no reference answers,
so this writes the answers for review rather than scoring them.

    pip install 'kev-llm[ray]'
    python examples/ray_offline_eval.py --actors 2 --repeat 4     # 64 rows on a local Ray
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray would otherwise report usage over the network

import ray  # noqa: E402 - after the environment it reads at import

from kev_integrations.ray import KevPredictor  # noqa: E402

DATA = Path(__file__).parent / "data" / "rag.jsonl"
OUT = Path(__file__).resolve().parent.parent / "out" / "ray_eval_answers.jsonl"
SYSTEM = "Answer the question using only the context. Be brief."


def rows(repeat: int) -> list[dict]:
    """One row per question and repeat: an id, the question, and the chat messages to answer."""
    items = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [
        {
            "id": f"{item['id']}-{r}",
            "question": item["question"],
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Context:\n{item['context']}\n\nQuestion: {item['question']}"},
            ],
        }
        for r in range(repeat)
        for item in items
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--actors", type=int, default=2, help="KevPredictor actors (one engine each)")
    ap.add_argument("--repeat", type=int, default=1, help="repeat the 16 questions to make a bigger job")
    ap.add_argument("--batch-size", type=int, default=16, help="rows per batch = per packed generate call")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs the local Ray may use")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    data = rows(args.repeat)
    ray.init(num_cpus=args.cpus, include_dashboard=False)
    try:
        start = time.perf_counter()
        answered = ray.data.from_items(data).map_batches(
            KevPredictor,
            fn_constructor_kwargs={"dtype": "float32", "sampling": {"temperature": 0, "max_tokens": args.max_tokens}},
            batch_size=args.batch_size,
            # one batch at a time per actor: a batch queued behind a busy actor would wait while another idles
            compute=ray.data.ActorPoolStrategy(size=args.actors, max_tasks_in_flight_per_actor=1),
            num_cpus=args.cpus / args.actors,  # the CPUs shared out: torch in each actor uses its share
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        done = tokens = errors = 0
        with args.out.open("w", encoding="utf-8") as out:
            for row in answered.iter_rows():  # streams: rows arrive as each batch finishes, in any order
                fields = ("id", "question", "text", "finish_reason", "prompt_tokens", "completion_tokens", "error")
                out.write(json.dumps({name: _plain(row[name]) for name in fields}, ensure_ascii=False) + "\n")
                done, tokens = done + 1, tokens + int(row["completion_tokens"])
                errors += row["error"] is not None
                if done % args.batch_size == 0 or done == len(data):
                    elapsed = time.perf_counter() - start
                    print(f"[{done}/{len(data)}] {elapsed:.1f} s, {done / elapsed:.2f} rows/s, "
                          f"{tokens / elapsed:.1f} generated tokens/s", flush=True)
        elapsed = time.perf_counter() - start
    finally:
        ray.shutdown()
    print(f"\n{done} rows ({errors} errors) with {args.actors} actor(s) in {elapsed:.1f} s (actor start-up and model "
          f"load included): {done / elapsed:.2f} rows/s, {tokens / elapsed:.1f} generated tokens/s")
    print(f"answers: {args.out}")


def _plain(value: object) -> object:
    """numpy scalars (Ray's rows hold np.int64) as plain Python values for JSON."""
    return value.item() if hasattr(value, "item") else value


if __name__ == "__main__":
    main()
