"""This tree against an earlier checkout, in the same run: load, one question and RAG-16 per dtype, and some tests.

For a change that should cost nothing (a reshaped layout, renamed modules), the ratio matters and
the machine's drift does not: each round runs every tree once, alternating, each measurement in a
fresh process with that tree first on `PYTHONPATH`, and the medians are compared. Before round 1
each tree loads once per dtype, untimed, so the GGUF conversion, the kernels' build and the bfloat16
path's choice are cached and `load` times a load from the cache.

Per dtype (`--dtypes`), one process per tree and round measures, in this order:
  load    `Engine.from_pretrained(dtype=...)` (the embedded model from its cached safetensors, the
          engine's defaults): its wall time, and the process's peak RSS right after it (ru_maxrss)
  one     after a warm-up (the last RAG chat, 4 tokens, so the first one's prompt is not in the
          prefix cache), ONE `generate` of the first RAG chat alone, greedy, 48 new tokens
  rag16   then ONE `generate` of the 16 RAG chats (benchmarks/workload.py), greedy, 48 new tokens
  docqa   then ONE `generate` of DOC-QA's 20 questions on one document (bench_prefix.py), greedy,
          48 new tokens (its document computed once: the prefix cache is on)
and, once per tree and round:
  tests   `pytest -q` on `--tests` (files both trees have), its wall time
The answers' token ids (one, rag16 and docqa, last round) are compared between the trees per dtype.

Usage: python benchmarks/bench_checkouts.py --baseline DIR [--rounds 3] [--dtypes float32,bfloat16]
       [--tests tests/test_schedule.py ...]
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
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench_checkouts.md"
DEFAULT_TESTS = ["tests/test_schedule.py", "tests/test_lifecycle.py", "tests/test_engine.py", "tests/test_lora.py"]
PRIME = "import sys; from kev_engine import Engine; Engine.from_pretrained(dtype=sys.argv[1]).close()"
WORKER = """
import json, resource, sys, time
from kev_engine import Engine
workloads, dtype = json.load(open(sys.argv[1])), sys.argv[2]
chats = workloads["rag"]
started = time.perf_counter()
engine = Engine.from_pretrained(dtype=dtype)
result = {"load": time.perf_counter() - started, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
engine.generate(chats[-1:], {"temperature": 0, "max_tokens": 4})
for name, batch in (("one", chats[:1]), ("rag16", chats), ("docqa", workloads["docqa"])):
    started = time.perf_counter()
    answers = engine.generate(batch, {"temperature": 0, "max_tokens": 48})
    result[name] = time.perf_counter() - started
    result[name + " tokens"] = [a.token_ids for a in answers]
print(json.dumps(result))
engine.close()
"""
# the worker's numbers: key -> (the report's label, its format)
MEASURES = {"load": ("load s", ".2f"), "rss": ("peak RSS after load MiB", ".0f"),
            "one": ("one question s", ".2f"), "rag16": ("RAG-16 generate s", ".2f"),
            "docqa": ("DOC-QA generate s", ".2f")}


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def _python(tree: Path, script: str, *argv: str) -> str:
    run = subprocess.run([sys.executable, "-c", script, *argv], env=_env(tree), cwd=tree,
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"a worker ({' '.join(argv)}) failed in {tree}:\n{run.stderr[-3000:]}")
    return run.stdout


def measure(tree: Path, chats_file: str, dtype: str) -> dict:
    """One fresh process: load (s), rss (MiB), one and rag16 (s), and their answers' token ids."""
    return json.loads(_python(tree, WORKER, chats_file, dtype).strip().splitlines()[-1])


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


def _row(label: str, fmt: str, samples: dict[str, list[float]]) -> str:
    this, base = statistics.median(samples["this tree"]), statistics.median(samples["baseline"])
    return f"| {label} | {this:{fmt}} | {base:{fmt}} | {this / base:.3f}x |"


def _same(answers: dict[tuple[str, str], dict], dtype: str, key: str) -> bool:
    return answers["this tree", dtype][f"{key} tokens"] == answers["baseline", dtype][f"{key} tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of an earlier commit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", type=lambda text: [d for d in text.split(",") if d], default="float32,bfloat16",
                        help="comma-separated dtypes for Engine.from_pretrained")
    parser.add_argument("--tests", nargs="*", default=DEFAULT_TESTS, help="test files (none: no tests)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_prefix import doc_qa_messages
    from workload import load_rag, rag_messages

    trees = {"this tree": ROOT, "baseline": args.baseline.resolve()}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"rag": [rag_messages(item) for item in load_rag()], "docqa": doc_qa_messages()}, handle)
    for tree in trees.values():
        for dtype in args.dtypes:
            _python(tree, PRIME, dtype)  # untimed: fills the caches a load reads
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: {name: [] for name in trees})
    answers: dict[tuple[str, str], dict] = {}
    for round_ in range(args.rounds):
        for name, tree in (trees.items() if round_ % 2 == 0 else reversed(trees.items())):
            parts = []
            for dtype in args.dtypes:
                result = answers[name, dtype] = measure(tree, handle.name, dtype)
                for key in MEASURES:
                    samples[f"{dtype} {key}"][name].append(result[key])
                parts.append(f"{dtype} load {result['load']:.2f} s ({result['rss']:.0f} MiB), "
                             f"one {result['one']:.2f} s, RAG-16 {result['rag16']:.2f} s, "
                             f"DOC-QA {result['docqa']:.2f} s")
            if args.tests:
                samples["tests"][name].append(tests(tree, args.tests))
                parts.append(f"tests {samples['tests'][name][-1]:.1f} s")
            print(f"round {round_ + 1}, {name}: {'; '.join(parts)}", flush=True)
    rows = [_row(f"{dtype} {label}", fmt, samples[f"{dtype} {key}"])
            for dtype in args.dtypes for key, (label, fmt) in MEASURES.items()]
    if args.tests:
        rows.append(_row("tests s", ".1f", samples["tests"]))
    same = [f"{dtype} one {_same(answers, dtype, 'one')}, RAG-16 {_same(answers, dtype, 'rag16')}, "
            f"DOC-QA {_same(answers, dtype, 'docqa')}" for dtype in args.dtypes]
    text = "\n".join([
        f"# bench_checkouts ({time.strftime('%Y-%m-%d')}, {_cpu()}, {os.cpu_count()} CPUs; "
        f"embedded model, {', '.join(args.dtypes)})", "",
        f"Medians of {args.rounds} alternating rounds; tests: {' '.join(args.tests) or 'none'}", "",
        "| measurement | this tree | baseline | this tree / baseline |", "|---|---|---|---|", *rows, "",
        f"answers identical (token ids, last round): {'; '.join(same)}", ""])
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
