"""What Ray Serve costs over `kev serve`: the same 16 RAG questions, the same client, three servers.

Servers (each a subprocess on 127.0.0.1, started and stopped here; embedded model, fp32):
1. ``kev serve``: one process, one engine (torch uses all CPUs);
2. ``kev serve --ray --replicas 1``: a local Ray, the ingress and one replica holding all CPUs;
3. ``kev serve --ray --replicas 2``: two replicas, an equal share of the CPUs each.

Measured per server: start-up until /health answers; after one warm-up batch, the median over
`--repeat` runs of one ``ChatOpenAI.batch()`` of the 16 questions (16 concurrent requests, greedy,
a fresh `cache_salt` each, so no run reuses another's prefix KV); the median latency
of `--single` one-at-a-time short requests (per-request overhead: the ingress hop and Serve's
routing); the prefill passes one batch took (the server's /metrics: how the 16 requests were
packed); and how many of the 16 answers equal `kev serve`'s.

Usage: python benchmarks/bench_ray_serve.py [--repeat 3] [--max-tokens 32] [--single 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import KEY, free_port, metric, server
from workload import load_rag, rag_messages

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_ray_serve.md"
SERVERS = {
    "kev serve": [],
    "kev serve --ray --replicas 1": ["--ray", "--replicas", "1"],
    "kev serve --ray --replicas 2": ["--ray", "--replicas", "2"],
}


def batch_seconds(base_url: str, model: str, max_tokens: int, salt: str) -> tuple[float, list[str]]:
    """Wall time of one ``ChatOpenAI.batch()`` of the 16 RAG chats (16 concurrent requests). A fresh
    `cache_salt` per run: no run reuses an earlier run's prefix KV (a replica that saw a question
    before would answer it almost without prefill, and which replica sees what is random)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key=KEY, model=model, max_tokens=max_tokens, temperature=0,
                     max_retries=0, timeout=1200, extra_body={"cache_salt": salt})
    messages = [[(m["role"], m["content"]) for m in rag_messages(item)] for item in load_rag()]
    t0 = time.perf_counter()
    replies = llm.batch(messages, config={"max_concurrency": len(messages)})
    return time.perf_counter() - t0, [str(r.content) for r in replies]


def single_latency(base: str, model: str, count: int) -> float:
    """Median seconds of `count` short requests sent one after another."""
    seconds = []
    with httpx.Client(timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as http:
        for i in range(count):
            body = {"model": model, "messages": [{"role": "user", "content": f"Say a number: {i}"}],
                    "max_tokens": 4, "temperature": 0, "cache_salt": f"single-{i}"}
            t0 = time.perf_counter()
            http.post(base + "/v1/chat/completions", json=body).raise_for_status()
            seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--single", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    results: dict[str, dict] = {}
    for label, extra in SERVERS.items():
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "kev_integrations", "serve", "--port", str(port), "--api-key", KEY, *extra]
        print(f"--- {label}", flush=True)
        t0 = time.perf_counter()
        with server(command, base + "/health", timeout=600):
            started = time.perf_counter() - t0
            model = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                              timeout=60).json()["data"][0]["id"]
            batch_seconds(base + "/v1", model, args.max_tokens, "warm-up")
            passes = metric(base, "kev_prefill_passes_total")
            runs = [batch_seconds(base + "/v1", model, args.max_tokens, f"run-{i}") for i in range(args.repeat)]
            passes = (metric(base, "kev_prefill_passes_total") - passes) / args.repeat
            single = single_latency(base, model, args.single)
        results[label] = {"start": started, "batch": statistics.median(s for s, _ in runs),
                          "answers": runs[0][1], "single": single, "passes": passes}
        print(f"    start {started:.1f} s, batch {results[label]['batch']:.2f} s, single {single * 1000:.0f} ms",
              flush=True)

    reference = results["kev serve"]
    lines = [f"# bench_ray_serve (embedded model, fp32, {os.cpu_count()} CPUs, loopback)", "",
             f"16 RAG questions through `ChatOpenAI.batch()` (16 concurrent requests, greedy, max_tokens "
             f"{args.max_tokens}), median of {args.repeat}; single = median of {args.single} one-at-a-time "
             "requests of 4 tokens.", "",
             "| server | start-up s | batch s | batch / kev serve | prefill passes per batch | single ms | "
             "answers equal to kev serve's |",
             "|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        same = sum(a == b for a, b in zip(r["answers"], reference["answers"]))
        lines.append(f"| {label} | {r['start']:.1f} | {r['batch']:.2f} | {r['batch'] / reference['batch']:.2f} | "
                     f"{r['passes']:.1f} | {r['single'] * 1000:.0f} | {same}/16 |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    RESULTS_MD.parent.mkdir(exist_ok=True)
    RESULTS_MD.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
