"""Speculative decoding that changes no bit: the same workloads with speculation off and on.

For each model and dtype, one process holds two engines over the same weights, `speculative="off"`
and `speculative="ngram"` (drafts from each question's own text, priced by the engine's cost
model), and times each workload on them in alternating rounds (off, on, off, on, ...), each
round with fresh prefix-cache keys; best of `--rounds` per engine. Workloads (bench_invariance's
prompts): "one" (the first RAG question alone), "rag16" (16 RAG questions with their own
passages), "docqa" (20 questions on one ~1,500-token document); greedy, answers ending at their
end-of-text or at --max-tokens. Reported per row: wall seconds off and on and their ratio, the
passes and decode steps each took, the draft tokens verified and the share taken, tokens per
decode step, and whether every answer's token ids are the same (they must be: speculation changes
no bit on the batch-invariant path).

Models: the embedded SmolLM2-135M-Instruct, or ``--model llama-0.7b``, a 0.7B Llama of random
weights built in --model-dir (its answers copy nothing, so drafts are rarely taken: there the
question is whether the scheduler turns them down so that nothing gets slower).

Usage: python benchmarks/bench_speculative.py [--rounds 3] [--dtype float32 bfloat16]
           [--workload one rag16 docqa] [--model embedded|llama-0.7b --model-dir DIR] [--out PATH]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_invariance import MODELS, WARM_UP, build_model, messages, write_report  # noqa: E402
from machine import cpu_line  # noqa: E402

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_speculative.md"
MAX_TOKENS = {"one": 48, "rag16": 48, "docqa": 32}
COUNTERS = ("forward_passes", "decode_steps", "generated_tokens", "draft_tokens", "draft_accepted_tokens")


def timed(engine: Any, prompts: list[Any], max_tokens: int, salt: str) -> dict[str, Any]:
    """One `generate` of `prompts`: wall seconds, the engine's counters over it, the answers' ids."""
    from kev_engine import SamplingParams

    before = engine.stats()
    started = time.perf_counter()
    answers = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=salt))
    wall = time.perf_counter() - started
    after = engine.stats()
    return {"wall_s": wall, "ids": [a.token_ids for a in answers],
            **{key: after[key] - before[key] for key in COUNTERS}}


def measure(model: str | None, dtype: str, workloads: list[str], rounds: int) -> list[dict[str, Any]]:
    from kev_engine import Engine

    engines = {mode: Engine.from_pretrained(model, dtype=dtype, speculative=mode) for mode in ("off", "ngram")}
    rows = []
    try:
        for engine in engines.values():
            engine.generate([WARM_UP] * 2)
        for workload in workloads:
            prompts, best = messages(workload), {}
            for round_ in range(rounds):
                for mode, engine in engines.items():
                    run = timed(engine, prompts, MAX_TOKENS[workload], f"{workload}-{mode}-{round_}")
                    print(f"  {workload} {dtype} {mode} round {round_}: {run['wall_s']:.3f} s", flush=True)
                    if mode not in best or run["wall_s"] < best[mode]["wall_s"]:
                        best[mode] = run
            off, on = best["off"], best["ngram"]
            rows.append({"dtype": dtype, "workload": workload, "off": off, "on": on, "same": off["ids"] == on["ids"],
                         "kernels": engines["off"].stats()["dtype_choice"]})
    finally:
        for engine in engines.values():
            engine.close()
    return rows


def report(rows: list[dict[str, Any]], model: str, rounds: int) -> str:
    import torch

    lines = [f"# bench_speculative: speculation off vs on ({model}; {cpu_line()}; torch {torch.__version__}, "
             f"{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"Wall = best of {rounds} alternating rounds per engine; greedy; the same answers required.", "",
             "| dtype | workload | off s | on s | on / off | passes off / on | decode steps off / on | "
             "drafted | taken | tokens per decode step off / on | same answers |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        off, on = row["off"], row["on"]
        taken = f"{on['draft_accepted_tokens']} ({on['draft_accepted_tokens'] / on['draft_tokens']:.0%})" \
            if on["draft_tokens"] else "0"
        per_step = [r["generated_tokens"] / max(r["decode_steps"], 1) for r in (off, on)]
        lines.append(f"| {row['dtype']} | {row['workload']} | {off['wall_s']:.3f} | {on['wall_s']:.3f} | "
                     f"{on['wall_s'] / off['wall_s']:.2f}x | {off['forward_passes']} / {on['forward_passes']} | "
                     f"{off['decode_steps']} / {on['decode_steps']} | {on['draft_tokens']} | {taken} | "
                     f"{per_step[0]:.1f} / {per_step[1]:.1f} | {'yes' if row['same'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--workload", nargs="+", default=list(MAX_TOKENS), choices=list(MAX_TOKENS))
    ap.add_argument("--model", default="embedded", choices=MODELS)
    ap.add_argument("--model-dir", dest="model_dir", help="where a random-weight --model is built (and reused)")
    ap.add_argument("--out", default=str(RESULTS_MD), help="the report's path (.md; its .json beside it)")
    args = ap.parse_args()
    model = None
    if args.model != "embedded":
        if not args.model_dir:
            ap.error(f"--model {args.model} needs --model-dir")
        model = str(build_model(args.model, Path(args.model_dir), None))
    rows = [row for dtype in args.dtype for row in measure(model, dtype, args.workload, args.rounds)]
    for row in rows:  # the answers are compared above; the report keeps counters, not ids
        row["off"].pop("ids")
        row["on"].pop("ids")
    write_report(args.out, report(rows, args.model, args.rounds), rows)
    if not all(row["same"] for row in rows):
        sys.exit("speculation changed an answer: see the report")


if __name__ == "__main__":
    main()
