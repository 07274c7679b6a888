"""Latency under mixed load: short questions arriving while ~8,000-token prompts prefill.

One run, one schedule for every system: a short chat question (about 60 prompt tokens, 16 new,
streamed) every `--short-every` seconds for `--duration` seconds, and `--long` long-context
requests (about 8,000 prompt tokens, 16 new) at evenly spaced times from the start. Systems:

  engine          Kev's Engine with its pass budget (pass_time_ms: the device's default)
  engine-unbound  the same engine with passes bounded by max_batch_tokens alone (pass_time_ms=inf)
  serve           `kev serve` on loopback (its default budget), streamed through HTTP
  llama-server    llama.cpp's server, if `--llama-server PATH` (with `--gguf`), the same token ids

Reported per system: the short questions' time to first token (p50, p99, max), the inter-token
latency p99 over every stream, the long requests' total time, and generated tokens per second
over the whole run. Inter-token latency is per token: a streamed piece that carries k tokens
after a gap g counts k gaps of g / k (Kev holds a token's text back while it may be the start of a
stop string or a partial character, and an end-of-text token has none: its piece then comes with
the next token's). How many tokens a piece carries: Kev's own `logprobs` (one entry per token),
in-process and through the OpenAI API; llama-server streams every token as its own event. The
gaps between pieces as a reader sees them (`piece gap p99`) are reported beside it. Then
(`--batches`) the RAG-16 and DOC-QA batch times with and without the budget, best of `--repeat`, in the same run.

Usage: python benchmarks/bench_latency.py [--duration 40] [--short-every 1.0] [--long 2]
       [--systems engine,engine-unbound,serve] [--batches] [--llama-server PATH --gguf FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefix import doc_qa_messages  # noqa: E402
from bench_server import KEY, free_port, server  # noqa: E402
from machine import cpu_line  # noqa: E402
from workload import SYSTEM_PROMPT, load_rag, rag_messages  # noqa: E402

from kev_engine import Engine, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_latency.md"
SHORT_NEW, LONG_NEW = 16, 16


@dataclass
class Stream:
    kind: str  # "short" or "long"
    sent: float
    pieces: list[float] = field(default_factory=list)  # arrival times of streamed pieces
    carried: list[int] = field(default_factory=list)  # tokens each piece carried
    done: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.pieces[0] - self.sent if self.pieces else None


def short_prompt(i: int, items: list[dict]) -> list[dict]:
    item = items[i % len(items)]
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Question {i}: {item['question']} Answer in one short sentence, in plain "
                                        "words, from what you know; no lists, no preamble."}]


def long_prompt(i: int, items: list[dict], engine: Engine, target: int = 7900) -> list[dict]:
    """A chat prompt of about `target` tokens: the workload's passages, repeated, and a question."""
    parts: list[str] = []
    k = i
    while True:
        parts.append(items[k % len(items)]["context"])
        k += 1
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": "Context:\n" + "\n\n".join(parts) + f"\n\nQuestion {i}: summarise it."}]
        if len(engine.encode(messages)) >= target:
            parts.pop()
            return [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": "Context:\n" + "\n\n".join(parts) + f"\n\nQuestion {i}: summarise it."}]


def schedule(args: argparse.Namespace) -> list[tuple[float, str, int]]:
    """(seconds from the start, kind, index) of every request, in time order."""
    shorts = [(j * args.short_every, "short", j) for j in range(int(args.duration / args.short_every))]
    longs = [(0.2 + j * args.duration / max(1, args.long), "long", j) for j in range(args.long)]
    return sorted(shorts + longs)


def drive(plan: list[tuple[float, str, int]], send: Callable[[str, int, Stream], None]) -> tuple[list[Stream], float]:
    """Send each request at its time (on its own thread); wait for every answer."""
    streams: list[Stream] = []
    threads: list[threading.Thread] = []
    start = time.perf_counter()
    for at, kind, index in plan:
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        stream = Stream(kind, time.perf_counter())
        streams.append(stream)
        thread = threading.Thread(target=_guarded, args=(send, kind, index, stream), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(900)
    return streams, time.perf_counter() - start


def _guarded(send: Callable[[str, int, Stream], None], kind: str, index: int, stream: Stream) -> None:
    try:
        send(kind, index, stream)
    except Exception as exc:  # noqa: BLE001 - a failed request is reported, not fatal to the run
        stream.error = f"{type(exc).__name__}: {exc}"
    stream.done = stream.done or time.perf_counter()


def engine_sender(engine: Engine, prompts: dict[tuple[str, int], Any]) -> Callable[[str, int, Stream], None]:
    def send(kind: str, index: int, stream: Stream) -> None:
        params = SamplingParams(temperature=0, max_tokens=SHORT_NEW if kind == "short" else LONG_NEW, ignore_eos=True,
                                logprobs=True)  # one entry per token: how many tokens each piece carries

        def on_text(piece: Any) -> None:
            stream.pieces.append(time.perf_counter())
            stream.carried.append(len(piece.logprobs or []))

        future = engine.submit(prompts[kind, index], params, on_text=on_text)
        stream.tokens = future.result(timeout=900).completion_tokens
        stream.done = time.perf_counter()
    return send


def serve_sender(base: str, prompts: dict[tuple[str, int], Any], model: str) -> Callable[[str, int, Stream], None]:
    def send(kind: str, index: int, stream: Stream) -> None:
        body = {"model": model, "messages": prompts[kind, index], "stream": True, "temperature": 0,
                "max_tokens": SHORT_NEW if kind == "short" else LONG_NEW, "ignore_eos": True, "logprobs": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=900,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                carried = sum(len((c.get("logprobs") or {}).get("content") or []) for c in chunk.get("choices", []))
                if carried:
                    stream.pieces.append(time.perf_counter())
                    stream.carried.append(carried)
                    stream.tokens += carried
        stream.done = time.perf_counter()
    return send


def llama_sender(base: str, ids: dict[tuple[str, int], list[int]]) -> Callable[[str, int, Stream], None]:
    def send(kind: str, index: int, stream: Stream) -> None:
        body = {"prompt": ids[kind, index], "n_predict": SHORT_NEW if kind == "short" else LONG_NEW, "stream": True,
                "temperature": 0, "top_k": 1, "cache_prompt": False, "ignore_eos": True}
        with httpx.stream("POST", base + "/completion", json=body, timeout=900) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: ") and "content" in (event := json.loads(line[6:])) and not event.get("stop"):
                    stream.pieces.append(time.perf_counter())  # one event per token, its text empty or not
                    stream.carried.append(1)
                    stream.tokens += 1
        stream.done = time.perf_counter()
    return send


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def summary(name: str, streams: list[Stream], wall: float) -> dict[str, Any]:
    shorts = [s for s in streams if s.kind == "short" and s.ttft is not None]
    ttfts = [s.ttft for s in shorts if s.ttft is not None]
    gaps = [b - a for s in streams for a, b in zip(s.pieces, s.pieces[1:])]
    per_token = [(b - a) / k for s in streams for a, b, k in zip(s.pieces, s.pieces[1:], s.carried[1:])
                 for _ in range(max(k, 1))]
    longs = [s.done - s.sent for s in streams if s.kind == "long" and s.done is not None]
    return {"system": name, "short": len(shorts), "errors": sum(s.error is not None for s in streams),
            "first_error": next((s.error for s in streams if s.error), None),
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p99": percentile(ttfts, 0.99), "ttft_max": max(ttfts, default=0),
            "itl_p99": percentile(per_token, 0.99), "piece_gap_p99": percentile(gaps, 0.99),
            "long_s": statistics.mean(longs) if longs else math.nan,
            "tokens_per_s": sum(s.tokens for s in streams) / wall}


def batch_times(repeat: int, dtype: str) -> list[dict[str, Any]]:
    """RAG-16 and DOC-QA as one generate() call, with the default budget and without, best of
    `repeat` runs taken in turns (which engine goes first alternates)."""
    rows = []
    workloads = {"RAG-16": ([rag_messages(item) for item in load_rag()], 48), "DOC-QA": (doc_qa_messages(), 32)}
    engines = {"budget": Engine.from_pretrained(dtype=dtype),
               "unbound": Engine.from_pretrained(dtype=dtype, pass_time_ms=math.inf)}
    try:
        for name, (prompts, new) in workloads.items():
            row: dict[str, Any] = {"workload": name}
            walls: dict[str, list[float]] = {label: [] for label in engines}
            for engine in engines.values():
                engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm, and a timed pass
            for run in range(repeat):  # the engines take turns, each first in every other turn: a VM's
                turn = list(engines.items())  # drift and the order's own effect fall on both alike
                for label, engine in turn if run % 2 == 0 else turn[::-1]:  # a salt per run: nothing cached
                    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True,
                                            cache_salt=f"{name}-{label}-{run}")
                    before = engine.stats()["prefill_passes"]
                    started = time.perf_counter()
                    engine.generate(prompts, params, adapters=None)
                    walls[label].append(time.perf_counter() - started)
                    row[f"{label}_prefill_passes"] = engine.stats()["prefill_passes"] - before
            for label, times in walls.items():
                row[f"{label}_s"] = min(times)
            row["ratio"] = row["budget_s"] / row["unbound_s"]
            rows.append(row)
    finally:
        for engine in engines.values():
            engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=40.0, help="seconds over which short questions arrive")
    ap.add_argument("--short-every", type=float, default=1.0)
    ap.add_argument("--long", type=int, default=2, help="long-context requests, evenly spaced from the start")
    ap.add_argument("--systems", default="engine,engine-unbound,serve")
    ap.add_argument("--batches", action="store_true", help="also time RAG-16 and DOC-QA with and without the budget")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the engines' dtype (auto: bf16 where it measures faster)")
    ap.add_argument("--llama-server", help="path of llama.cpp's llama-server binary")
    ap.add_argument("--gguf", help="the GGUF llama-server loads (same precision as Kev's)")
    args = ap.parse_args()

    items = load_rag()
    probe = Engine.from_pretrained(dtype=args.dtype)
    dtype, pass_ms = str(probe.dtype).removeprefix("torch."), probe.pass_time_ms
    prompts: dict[tuple[str, int], Any] = {}
    plan = schedule(args)
    for _, kind, index in plan:
        prompts[kind, index] = short_prompt(index, items) if kind == "short" else long_prompt(index, items, probe)
    ids = {key: probe.encode(prompt) for key, prompt in prompts.items()}
    short_len = statistics.mean([len(v) for (k, _), v in ids.items() if k == "short"] or [0])
    long_len = statistics.mean([len(v) for (k, _), v in ids.items() if k == "long"] or [0])
    probe.close()

    results = []
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    systems += ["llama-server"] if args.llama_server else []
    for system in systems:
        print(f"bench_latency: {system} ...", file=sys.stderr, flush=True)
        if system.startswith("engine"):
            engine = Engine.from_pretrained(dtype=args.dtype,
                                            pass_time_ms=math.inf if system == "engine-unbound" else None)
            engine.generate([prompts["short", 0]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
            try:
                streams, wall = drive(plan, engine_sender(engine, prompts))
                stats = engine.stats()
            finally:
                engine.close()
            row = summary(system, streams, wall)
            row["pass_p99_s"] = _histogram_p99(stats["pass_seconds"])
            results.append(row)
        elif system == "serve":
            base = f"http://127.0.0.1:{(port := free_port())}"
            with server([sys.executable, "-m", "kev_integrations", "serve", "--port", str(port), "--api-key", KEY],
                        base + "/health"):
                models = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
                streams, wall = drive(plan, serve_sender(base, prompts, models["data"][0]["id"]))
            results.append(summary(system, streams, wall))
        elif system == "llama-server":
            base = f"http://127.0.0.1:{(port := free_port())}"
            with server([args.llama_server, "-m", args.gguf, "-np", "4", "-kvu", "-c", "20000", "--host", "127.0.0.1",
                         "--port", str(port), "--no-webui", "-lv", "0"], base + "/health"):
                streams, wall = drive(plan, llama_sender(base, ids))
            results.append(summary(system, streams, wall))
        else:
            raise SystemExit(f"unknown system {system!r}; use engine, engine-unbound, serve, llama-server")

    lines = [f"# bench_latency ({time.strftime('%Y-%m-%d')}, {cpu_line()}, {dtype}, pass_time_ms {pass_ms:g})", "",
             f"{len([p for p in plan if p[1] == 'short'])} short questions ({short_len:.0f} prompt tokens, "
             f"{SHORT_NEW} new) every {args.short_every:g} s for {args.duration:g} s; {args.long} long requests "
             f"({long_len:.0f} prompt tokens, {LONG_NEW} new), all streamed.", "",
             "| system | short TTFT p50 s | p99 s | max s | inter-token p99 s | piece gap p99 s | long request s | "
             "tokens/s | pass p99 s | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['system']} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {r['ttft_max']:.2f} | "
                     f"{r['itl_p99']:.2f} | {r['piece_gap_p99']:.2f} | {r['long_s']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{r.get('pass_p99_s', math.nan):.2f} | {r['errors']} |")
        if r["first_error"]:
            lines.append(f"|  | first error: {r['first_error'][:120]} |")
    if args.batches:
        lines += ["", "| batch | with budget s | prefill passes | unbound s | prefill passes | ratio |",
                  "|---|---|---|---|---|---|"]
        for row in batch_times(args.repeat, args.dtype):
            lines.append(f"| {row['workload']} | {row['budget_s']:.2f} | {row['budget_prefill_passes']} | "
                         f"{row['unbound_s']:.2f} | {row['unbound_prefill_passes']} | {row['ratio']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)


def _histogram_p99(snapshot: dict[str, Any]) -> float:
    """The smallest bucket bound holding 99 % of the observations (an upper bound on the p99)."""
    need = 0.99 * snapshot["count"]
    for bound, count in snapshot["buckets"]:
        if count >= need:
            return math.inf if bound == "+Inf" else float(bound)
    return math.nan


if __name__ == "__main__":
    main()
