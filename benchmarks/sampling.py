"""RAG-16 decode steps with every row penalised and asking for top-5 logprobs, against plain rows.

Run through ``python benchmarks/bench_engine.py --sampling``. One engine, one process, the same
16 prompts; both modes sample at temperature 0.8 with a seed per row and ``ignore_eos`` (so all
16 rows run every step of every run, whatever they say). The penalised mode adds
presence_penalty 0.5, frequency_penalty 0.5, repetition_penalty 1.1 and top_logprobs=5 on
every row. The modes alternate, `repeat` runs each (fresh cache salts: no run reuses another's
prefix KV), and what is reported is the median wall time of the pure decode steps with all 16
rows running, and the median time of the sampling stage alone (`Sampler.sample`: penalties,
grammar, draw, logprobs) inside those steps — the part the settings change — over all runs,
and the best run's medians (a shared VM's neighbours slow whole runs, not single modes).
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from kev_engine import Engine, SamplingParams

PENALISED = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "logprobs": True,
             "top_logprobs": 5}
LIMIT = 0.05  # the bound: penalised + logprob rows may cost at most 5 % more per decode step


def _timed_run(engine: Engine, messages: list, extra: dict[str, Any], max_tokens: int, salt: str) -> dict[str, Any]:
    """One generate call: (step seconds, sampling seconds) of each pure decode step with every row running."""
    rows = len(messages)
    steps: list[tuple[float, float]] = []
    sample_s: list[float] = []
    sampler = engine._stepper.sampler  # the sample stage, timed alone
    step, sample = engine.step, sampler.sample

    def timed_sample(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return sample(*args)
        finally:
            sample_s.append(time.perf_counter() - t0)

    def timed_step() -> int:
        sample_s.clear()
        decoding = engine.stats()["running"] == rows and not engine.stats()["waiting"]
        t0 = time.perf_counter()
        ran = step()
        elapsed = time.perf_counter() - t0
        if decoding and ran == rows and len(sample_s) == 1:
            steps.append((elapsed, sample_s[0]))
        return ran

    engine.step, sampler.sample = timed_step, timed_sample  # type: ignore[method-assign]
    try:
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True, cache_salt=salt,
                                 **extra) for i in range(rows)]
        replies = engine.generate(messages, params)
    finally:
        del engine.step, sampler.sample
    assert all(len(r.token_ids) == max_tokens for r in replies)
    return {"steps": steps, "logprobs": sum(len(r.logprobs or ()) for r in replies)}


def run_sampling(messages: list, max_tokens: int, repeat: int, results_md: Path) -> None:
    engine = Engine.from_pretrained(dtype="float32")
    salts = (f"sampling-{i}" for i in itertools.count())
    _timed_run(engine, messages[:2], PENALISED, 4, next(salts))  # warm-up: kernels, first-call costs
    modes: dict[str, list[tuple[float, float]]] = {"plain": [], "penalised": []}
    best: dict[str, tuple[float, float]] = {}  # per mode: the run with the lowest median step
    for run in range(repeat):
        order = ["plain", "penalised"] if run % 2 == 0 else ["penalised", "plain"]
        for mode in order:
            steps = _timed_run(engine, messages, PENALISED if mode == "penalised" else {}, max_tokens,
                               next(salts))["steps"]
            modes[mode] += steps
            medians = (1000 * statistics.median(s for s, _ in steps), 1000 * statistics.median(x for _, x in steps))
            best[mode] = min(best.get(mode, medians), medians)
            print(f"run {run} {mode}: {len(steps)} steps, median step {medians[0]:.2f} ms, "
                  f"sampling {medians[1]:.2f} ms", flush=True)
    stats = engine.stats()
    engine.close()
    summary = {mode: {"steps": len(v), "step_ms": 1000 * statistics.median(s for s, _ in v),
                      "sample_ms": 1000 * statistics.median(x for _, x in v), "best_step_ms": best[mode][0],
                      "best_sample_ms": best[mode][1]} for mode, v in modes.items()}
    plain, penalised = summary["plain"], summary["penalised"]
    step_ratio = penalised["step_ms"] / plain["step_ms"]
    best_ratio = penalised["best_step_ms"] / plain["best_step_ms"]
    sample_extra = (penalised["sample_ms"] - plain["sample_ms"]) / plain["step_ms"]
    md = "\n".join([
        f"# bench_engine --sampling (RAG-16, {len(messages)} rows, {max_tokens} tokens, repeat {repeat})",
        "",
        f"Model {stats['dtype']} embedded SmolLM2-135M-Instruct, batch_invariant={stats['batch_invariant']}. "
        "Both modes: temperature 0.8, a seed per row, ignore_eos. Penalised: " + json.dumps(PENALISED) + ".",
        "",
        "| mode | decode steps measured | median step (ms) | median sampling stage (ms) | best run: step / sampling |",
        "|---|---|---|---|---|",
        *(f"| {mode} | {v['steps']} | {v['step_ms']:.2f} | {v['sample_ms']:.2f} | {v['best_step_ms']:.2f} / "
          f"{v['best_sample_ms']:.2f} |" for mode, v in summary.items()),
        "",
        f"Penalised step / plain step: {step_ratio:.3f} ({100 * (step_ratio - 1):+.1f} %) over all steps, "
        f"{best_ratio:.3f} ({100 * (best_ratio - 1):+.1f} %) best run against best run. "
        f"Sampling-stage difference as a share of the plain step: {100 * sample_extra:+.1f} % "
        f"(limit {100 * LIMIT:.0f} %).",
        "",
    ])
    results_md.parent.mkdir(parents=True, exist_ok=True)
    results_md.write_text(md)
    print("\n" + md)
