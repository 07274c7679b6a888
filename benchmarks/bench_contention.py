"""Kev on a machine it shares: idle, then with one core kept busy by another program.

What it measures (greedy, the embedded model, `dtype="auto"`), each system in its own process, idle
and then with a separate process spinning on one core (a plain `while True: pass`, started after
the warm-up, killed after the timing):

* ``kev``          - Kev with its default threads (one per core), `Engine.generate` on all prompts at once.
* ``kev_1thread``  - the same with `threads=1`: what a user would set by hand to get out of the way.
* ``llama_server`` - llama.cpp's server (``-t``/``-tb`` = the cores, one slot per prompt) on the shipped
  Q4_1 GGUF, same prompt ids, every request at once (``--llama-server PATH``; else skipped).

Workloads: RAG-16 (16 questions, each with its own passage, 48 new tokens) and CHAIN-6 (the first six
of them, 32 new tokens: what a chain's `batch()` of six questions sends). Wall = the median of
``--repeat`` timed runs (a busy neighbour makes single runs swing), best beside it; each busy run's
token ids are compared with the idle run's (Kev's are bitwise batch-invariant: the same tokens
whatever the load). Kev's prefill passes are counted too: the pass budget learns the machine's pace.

Usage: python benchmarks/bench_contention.py [--repeat 5] [--llama-server PATH] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import GGUF_NAME, gguf_dir
from bench_invariance import answer_worker, llama_server_run, prompt_ids, run_worker, write_report
from workload import load_rag, rag_messages

CORES = len(os.sched_getaffinity(0))
WORKLOADS = {"rag16": ("RAG-16", 16, 48), "chain6": ("CHAIN-6", 6, 32)}
SYSTEMS = ("kev", "kev_1thread", "llama_server")
RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_contention.md"
WARM_UP = [{"role": "user", "content": "Say hello."}]


def busy_core() -> subprocess.Popen[bytes]:
    """Another program keeping one core busy until it is killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def messages(workload: str) -> list[Any]:
    return [rag_messages(item) for item in load_rag()][: WORKLOADS[workload][1]]


def timed(run: Any, repeat: int) -> tuple[list[float], Any]:
    walls, out = [], None
    for i in range(repeat):
        started = time.perf_counter()
        out = run(i)
        walls.append(time.perf_counter() - started)
    return walls, out


def kev_worker(data: dict) -> dict:
    """Kev idle, then beside a busy core, in this process."""
    from kev_engine import Engine, SamplingParams

    engine = Engine.from_pretrained(None, threads=data["threads"])
    msgs, max_tokens = messages(data["workload"]), WORKLOADS[data["workload"]][2]
    engine.generate([WARM_UP], SamplingParams(temperature=0, max_tokens=8))
    result: dict[str, Any] = {"threads": engine.stats()["threads"], "dtype": engine.stats()["dtype"]}
    for condition in ("idle", "busy"):
        neighbour = busy_core() if condition == "busy" else None
        try:
            before = engine.stats()["prefill_passes"]

            def run(i: int, salt: str = condition) -> list[list[int]]:
                sampling = SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=f"{salt}-{i}")
                return [a.token_ids for a in engine.generate(msgs, sampling)]

            walls, tokens = timed(run, data["repeat"])
            passes = (engine.stats()["prefill_passes"] - before) / data["repeat"]
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        result[condition] = {"walls": walls, "tokens": tokens, "prefill_passes": passes}
    engine.close()
    return result


def llama_run(binary: str, workload: str, repeat: int) -> dict:
    _, count, max_tokens = WORKLOADS[workload]
    ids = prompt_ids("rag16")[:count]  # CHAIN-6: the first six of RAG-16's, as `messages` takes them
    result: dict[str, Any] = {}
    for condition in ("idle", "busy"):
        neighbour = busy_core() if condition == "busy" else None
        try:
            run = llama_server_run(binary, Path(gguf_dir()) / GGUF_NAME, ids, max_tokens, repeat)
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        result[condition] = {"walls": run["walls"], "command": run["command"]}
    return result


def summary(walls: list[float]) -> tuple[float, float]:
    return statistics.median(walls), min(walls)


def report(rows: list[dict], repeat: int) -> str:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    lines = [f"# bench_contention: idle vs one core kept busy ({CORES} cores, {cpu}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"Median (best) of {repeat} timed runs after a warm-up; busy = a separate process spinning on one core.",
             "", "| workload | system | threads | idle s | busy s | busy / idle | busy vs kev 1 thread busy | "
             "prefill passes idle → busy | busy tokens = idle |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        one = row["results"].get("kev_1thread", {})
        one_busy = summary(one["busy"]["walls"])[0] if "busy" in one else None
        for name in SYSTEMS:
            r = row["results"].get(name)
            if r is None:
                continue
            if "skipped" in r:
                lines.append(f"| {row['workload']} | {name} | | {r['skipped']} | | | | | |")
                continue
            idle, busy = summary(r["idle"]["walls"]), summary(r["busy"]["walls"])
            vs_one = f"{busy[0] / one_busy:.2f}x" if one_busy and name != "kev_1thread" else ""
            passes = (f"{r['idle']['prefill_passes']:.1f} → {r['busy']['prefill_passes']:.1f}"
                      if "prefill_passes" in r["idle"] else "")
            same = str(r["busy"]["tokens"] == r["idle"]["tokens"]) if "tokens" in r["idle"] else "n/a"
            lines.append(f"| {row['workload']} | {name} | {r.get('threads', CORES)} | {idle[0]:.2f} ({idle[1]:.2f}) | "
                         f"{busy[0]:.2f} ({busy[1]:.2f}) | {busy[0] / idle[0]:.2f}x | {vs_one} | {passes} | {same} |")
    commands = {r["results"]["llama_server"]["idle"]["command"] for r in rows
                if "idle" in r["results"].get("llama_server", {})}
    if commands:
        lines += ["", "llama-server arguments: " + "; ".join(sorted(commands))]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--llama-server", dest="llama_server", help="path of a llama-server binary (else skipped)")
    ap.add_argument("--out", default=str(RESULTS_MD), help="the report's path (.md; its .json beside it)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        answer_worker(args.worker, kev_worker)
        return
    rows = []
    for workload in args.workload:
        title = WORKLOADS[workload][0]
        results: dict[str, dict] = {}
        for name, threads in (("kev", None), ("kev_1thread", 1)):
            if name in args.systems:
                print(f"--- {title} {name}", flush=True)
                results[name] = run_worker(name, {"workload": workload, "threads": threads, "repeat": args.repeat},
                                           script=__file__)
        if "llama_server" in args.systems:
            print(f"--- {title} llama_server", flush=True)
            if args.llama_server:
                try:
                    results["llama_server"] = llama_run(args.llama_server, workload, args.repeat)
                except (OSError, RuntimeError) as exc:
                    results["llama_server"] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
            else:
                results["llama_server"] = {"skipped": "no --llama-server given"}
        rows.append({"workload": title, "results": results})
        print(json.dumps({k: {c: v[c].get("walls") for c in ("idle", "busy") if c in v}
                          for k, v in results.items()}), flush=True)
    md = report(rows, args.repeat)
    write_report(args.out, md, rows)


if __name__ == "__main__":
    main()
