"""This tree against an earlier checkout, in the same run: RAG-16's wall time and some tests' time.

For a change that should cost nothing (a reshaped layout, renamed modules), the ratio matters and
the machine's drift does not: each round runs every tree once, alternating, each in a fresh
process with that tree first on `PYTHONPATH`, and the medians are compared.

  rag16   `Engine.from_pretrained()` (the embedded model, fp32, the engine's defaults), a warm-up,
          then ONE `generate` of the 16 RAG chats (benchmarks/workload.py), greedy, 48 new tokens
  tests   `pytest -q` on `--tests` (files both trees have), its wall time

Usage: python benchmarks/bench_checkouts.py --baseline DIR [--rounds 3] [--tests tests/test_schedule.py ...]
(make DIR with `git worktree add DIR COMMIT`.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench_checkouts.md"
DEFAULT_TESTS = ["tests/test_schedule.py", "tests/test_lifecycle.py", "tests/test_engine.py", "tests/test_lora.py"]
RAG_WORKER = """
import json, sys, time
from kev_engine import Engine
chats = json.load(open(sys.argv[1]))
engine = Engine.from_pretrained(dtype="float32")
engine.generate(chats[:1], {"temperature": 0, "max_tokens": 4})
started = time.perf_counter()
answers = engine.generate(chats, {"temperature": 0, "max_tokens": 48})
print(json.dumps({"seconds": time.perf_counter() - started, "tokens": [a.token_ids for a in answers]}))
engine.close()
"""


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def rag16(tree: Path, chats_file: str) -> tuple[float, list[list[int]]]:
    out = subprocess.run([sys.executable, "-c", RAG_WORKER, chats_file], env=_env(tree), cwd=tree,
                         capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["seconds"], result["tokens"]


def tests(tree: Path, files: list[str]) -> float:
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], env=_env(tree),
                         cwd=tree, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"the tests failed in {tree}:\n{run.stdout[-3000:]}")
    return time.perf_counter() - started


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of an earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tests", nargs="*", default=DEFAULT_TESTS, help="test files (none: RAG-16 alone)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from workload import load_rag, rag_messages

    trees = {"this tree": ROOT, "baseline": args.baseline.resolve()}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump([rag_messages(item) for item in load_rag()], handle)
    rag: dict[str, list[float]] = {name: [] for name in trees}
    suite: dict[str, list[float]] = {name: [] for name in trees}
    answers: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds):
        for name, tree in (trees.items() if round_ % 2 == 0 else reversed(trees.items())):
            seconds, answers[name] = rag16(tree, handle.name)
            rag[name].append(seconds)
            suite[name].append(tests(tree, args.tests) if args.tests else 0.0)
            print(f"round {round_ + 1}, {name}: RAG-16 {seconds:.2f} s, tests {suite[name][-1]:.1f} s", flush=True)
    same = answers["this tree"] == answers["baseline"]
    rows = [f"| {name} | {statistics.median(rag[name]):.2f} | {statistics.median(suite[name]):.1f} |"
            for name in trees]
    ratio_rag = statistics.median(rag["this tree"]) / statistics.median(rag["baseline"])
    ratio_tests = statistics.median(suite["this tree"]) / (statistics.median(suite["baseline"]) or 1.0)
    text = "\n".join([
        f"# bench_checkouts ({time.strftime('%Y-%m-%d')}, {_cpu()}, {os.cpu_count()} CPUs; embedded model fp32)", "",
        f"Medians of {args.rounds} alternating rounds; tests: {' '.join(args.tests) or 'none'}", "",
        "| tree | RAG-16 generate s | tests s |", "|---|---|---|", *rows, "",
        f"this tree / baseline: RAG-16 {ratio_rag:.3f}x" + (f", tests {ratio_tests:.3f}x" if args.tests else "") + "; "
        f"RAG-16 answers identical: {same}", ""])
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
