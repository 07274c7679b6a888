"""Ray Data throughput: the RAG questions through KevPredictor with 1 actor vs 2, and in-process.

The 16 RAG questions are repeated to ``--rows`` rows (default 64), each copy made distinct by a
tag at the start of its system prompt so no engine reuses an earlier copy's KV (the prefix cache
would otherwise favour whichever mode sees a question twice). Greedy, ``--max-tokens`` 32, the
embedded model in fp32, batches of ``--batch-size`` rows (one packed ``generate`` call each).

* ``engine``  - one ``Engine`` in this process, ``generate`` on each batch in turn (torch's own
                thread count); model load not timed.
* ``ray x1``  - a local Ray with all CPUs, 1 KevPredictor actor with ``num_cpus`` = all of them.
* ``ray x2``  - the same Ray, 2 actors with half the CPUs each.

For Ray: wall = ``map_batches`` to the last row (actor start-up, imports and model load
included), and the busy span = the first batch's start to the last batch's end inside the actors
(timed there), which is the steady-state throughput. Answers are compared with ``engine``'s.

Usage: python benchmarks/bench_ray_data.py [--rows 64] [--batch-size 16] [--max-tokens 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray would otherwise report usage over the network

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import SYSTEM_PROMPT, load_rag  # noqa: E402

from kev_engine import Engine, SamplingParams  # noqa: E402
from kev_integrations.ray import KevPredictor  # noqa: E402

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_ray_data.md"
CORES = os.cpu_count() or 1


def make_rows(num_rows: int) -> list[dict[str, Any]]:
    """The RAG questions repeated to `num_rows`, copy c's system prompt tagged "(copy c)"."""
    items = load_rag()
    return [
        {"id": f"{item['id']}-{i // len(items)}",
         "messages": [{"role": "system", "content": f"(copy {i // len(items)}) {SYSTEM_PROMPT}"},
                      {"role": "user", "content": f"Context:\n{item['context']}\n\nQuestion: {item['question']}"}]}
        for i, item in ((i, items[i % len(items)]) for i in range(num_rows))
    ]


class TimedPredictor(KevPredictor):
    """KevPredictor plus, per row, its actor's pid, torch threads and its batch's start/end times."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.time()
        out = super().__call__(batch)
        n = len(out["text"])
        out.update(actor=np.full(n, os.getpid()), threads=np.full(n, torch.get_num_threads()),
                   batch_start=np.full(n, start), batch_end=np.full(n, time.time()))
        return out


def run_engine(rows: list[dict[str, Any]], batch_size: int, max_tokens: int) -> dict[str, Any]:
    engine = Engine.from_pretrained(dtype="float32")
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    answers = []
    for i in range(0, len(rows), batch_size):
        answers += engine.generate([row["messages"] for row in rows[i : i + batch_size]], sampling)
    wall = time.perf_counter() - start
    engine.close()
    return {"wall": wall, "span": wall, "threads": {torch.get_num_threads()}, "per_actor": [len(rows)],
            "texts": {row["id"]: a.text for row, a in zip(rows, answers)},
            "tokens": sum(a.completion_tokens for a in answers), "cached": sum(a.cached_tokens for a in answers),
            "errors": 0}


def run_ray(rows: list[dict[str, Any]], actors: int, batch_size: int, max_tokens: int) -> dict[str, Any]:
    import ray

    start = time.perf_counter()
    out = ray.data.from_items(rows).map_batches(
        TimedPredictor,
        fn_constructor_kwargs={"dtype": "float32", "sampling": {"temperature": 0, "max_tokens": max_tokens}},
        batch_size=batch_size,
        # one batch at a time per actor: queued behind a busy actor, a batch would wait while another idles
        compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
        num_cpus=CORES / actors,
    ).take_all()
    wall = time.perf_counter() - start
    pids = [int(r["actor"]) for r in out]
    span = max(r["batch_end"] for r in out) - min(r["batch_start"] for r in out)
    return {"actors": actors, "wall": wall, "span": span,
            "threads": {int(r["threads"]) for r in out}, "per_actor": sorted(pids.count(p) for p in set(pids)),
            "texts": {r["id"]: r["text"] for r in out}, "tokens": sum(int(r["completion_tokens"]) for r in out),
            "cached": sum(int(r["cached_tokens"]) for r in out), "errors": sum(r["error"] is not None for r in out)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=RESULTS_MD)
    args = ap.parse_args()
    rows = make_rows(args.rows)

    print("--- engine in-process", flush=True)
    results = {"engine (in-process)": run_engine(rows, args.batch_size, args.max_tokens)}
    import ray

    ray.init(num_cpus=CORES, include_dashboard=False, log_to_driver=False)
    try:
        for actors in (1, 2):
            print(f"--- ray, {actors} actor(s)", flush=True)
            results[f"ray x{actors}"] = run_ray(rows, actors, args.batch_size, args.max_tokens)
    finally:
        ray.shutdown()

    reference = results["engine (in-process)"]["texts"]
    lines = [
        f"# bench_ray_data: {args.rows} RAG rows (16 questions, distinct copies), greedy, "
        f"max_tokens={args.max_tokens}, batches of {args.batch_size}, embedded model fp32 CPU, {CORES} CPUs, "
        f"torch {torch.__version__}, ray {ray.__version__}, {os.uname().machine}", "",
        "| mode | actors x CPUs each | torch threads | rows per actor | wall s | busy span s | rows/s (wall) | "
        "rows/s (span) | tokens/s (span) | generated tokens | cached prompt tokens | errors | answers = engine's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        layout = f"{r['actors']} x {CORES / r['actors']:g}" if "actors" in r else "in-process"
        same = sum(r["texts"].get(key) == text for key, text in reference.items())
        lines.append(
            f"| {name} | {layout} | {sorted(r['threads'])} | {r['per_actor']} | {r['wall']:.1f} | {r['span']:.1f} | "
            f"{args.rows / r['wall']:.2f} | {args.rows / r['span']:.2f} | {r['tokens'] / r['span']:.1f} | "
            f"{r['tokens']} | {r['cached']} | {r['errors']} | {same}/{len(reference)} |"
        )
    lines += ["", "wall: from map_batches to the last row, actor start-up and model load included (engine: the "
              "generate calls only); busy span: first batch start to last batch end, timed inside the actors."]
    md = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(md)
    print(md)


if __name__ == "__main__":
    main()
