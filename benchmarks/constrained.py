"""RAG-16 with every question constrained to a JSON answer schema vs the same 16 unconstrained.

Run through ``python benchmarks/bench_engine.py --constrained``. One engine, one process, the
same prompts; the modes alternate, `repeat` runs each (fresh cache salts, so no run reuses
another's prefix KV), and the best of each is kept. The two modes generate different replies, so beside the wall
time it reports what is comparable: the median decode step with all 16 rows running, and the
time spent in the grammar work itself (bitmask fill + apply) as a share of the run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kev_engine import Engine, SamplingParams
from kev_engine import engine as engine_module

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 300},
        "found_in_context": {"type": "boolean"},
    },
    "required": ["answer", "found_in_context"],
}


def _timed_run(engine: Engine, messages: list, sampling: dict[str, Any], grammar_s: list[float]) -> dict[str, Any]:
    """One generate call; per-step durations (with their running rows) and the grammar time."""
    steps: list[tuple[float, int, int]] = []
    step = engine.step

    def timed_step() -> int:
        t0 = time.perf_counter()
        ran = step()
        steps.append((time.perf_counter() - t0, ran, engine.stats()["running"]))
        return ran

    engine.step = timed_step  # the scheduler thread calls engine.step() for every pass
    grammar_s.clear()
    before = engine.stats()
    t0 = time.perf_counter()
    try:
        replies = engine.generate(messages, [SamplingParams(**sampling)] * len(messages))
    finally:
        del engine.step
    wall = time.perf_counter() - t0
    after = engine.stats()
    full = sorted(d for d, ran, running in steps if ran == running == len(messages))
    return {
        "wall_s": wall,
        "passes": after["forward_passes"] - before["forward_passes"],
        "generated_tokens": sum(r.completion_tokens for r in replies),
        "decode_step_ms": 1000 * full[len(full) // 2] if full else float("nan"),
        "full_steps": len(full),
        "grammar_s": sum(grammar_s),
        "finish": [r.finish_reason for r in replies],
        "texts": [r.text for r in replies],
    }


def _instrument(grammar_s: list[float]) -> None:
    """Time the engine's grammar work per pass: filling and applying the constrained rows' bitmask."""
    mask = engine_module.mask_logits

    def timed_mask(logits: Any, matchers: list[Any], vocab: int) -> list[int]:
        t0 = time.perf_counter()
        try:
            return mask(logits, matchers, vocab)
        finally:
            grammar_s.append(time.perf_counter() - t0)

    engine_module.mask_logits = timed_mask


def run_constrained(messages: list, max_tokens: int, repeat: int, results_md: Path) -> None:
    engine = Engine.from_pretrained()
    grammar_s: list[float] = []
    _instrument(grammar_s)
    salts = iter(range(10_000))
    modes = {
        "unconstrained": {"temperature": 0, "max_tokens": max_tokens},
        "json_schema": {"temperature": 0, "max_tokens": max_tokens, "json_schema": ANSWER_SCHEMA},
    }
    engine.generate(messages[:1], SamplingParams(max_tokens=4, json_schema=ANSWER_SCHEMA))  # warm-up + compile
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    for _ in range(repeat):  # interleaved, so neither mode gets all the warm (already touched) KV pages
        for name, sampling in modes.items():
            runs[name].append(_timed_run(engine, messages, {**sampling, "cache_salt": f"c{next(salts)}"}, grammar_s))
    results = {name: min(rs, key=lambda r: r["wall_s"]) for name, rs in runs.items()}
    valid = 0
    for text, finish in zip(results["json_schema"]["texts"], results["json_schema"]["finish"]):
        try:
            data = json.loads(text)
            valid += finish == "stop" and set(data) == {"answer", "found_in_context"}
        except ValueError:
            pass
    free, cons = results["unconstrained"], results["json_schema"]
    step_ratio = cons["decode_step_ms"] / free["decode_step_ms"]
    lines = [
        f"# bench_engine --constrained (RAG-16, max_tokens={max_tokens}, best of {repeat}, fp32, embedded model)",
        "",
        "| mode | wall s | passes | generated tokens | ms / token | median 16-row decode step ms | grammar s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['wall_s']:.2f} | {r['passes']} | {r['generated_tokens']} | "
                     f"{1000 * r['wall_s'] / r['generated_tokens']:.1f} | {r['decode_step_ms']:.1f} | "
                     f"{r['grammar_s']:.3f} |")
    lines += [
        "",
        f"- constrained replies that parse with both keys and finished by their grammar: {valid}/{len(messages)}",
        f"- decode step, constrained / unconstrained: {step_ratio:.3f} (goal: overhead <= 10 %)",
        f"- grammar work (bitmask fill + apply) in the constrained run: {cons['grammar_s']:.3f} s = "
        f"{100 * cons['grammar_s'] / cons['wall_s']:.1f} % of its wall time",
    ]
    md = "\n".join(lines) + "\n"
    results_md.parent.mkdir(parents=True, exist_ok=True)
    results_md.write_text(md)
    print(md)
    engine.close()
