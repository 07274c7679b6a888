"""Load test of `kev serve` on loopback, and ChatOpenAI.batch() against kev serve vs llama.cpp's server.

1. ``load``: N chat requests (greedy, short answers) from C concurrent clients. Reported: none
   lost (every request answered 200 with a finish reason), none mismatched (every 20th prompt,
   asked again alone afterwards, gets the same text), p50/p99 latency, requests/s, tokens/s.
2. ``disconnect``: streamed requests, a fifth of whose clients hang up after the first chunk,
   three times. Reported per run: requests cancelled, the server's RSS before and once idle
   again, KV in use (back to 0) and KV kept in the LRU prefix cache (bounded by the budget).
3. ``side_by_side``: the 16 RAG questions through LangChain's ``ChatOpenAI.batch()`` against
   ``kev serve`` and against llama-cpp-python's server on the same GGUF (when installed).

Every server is a subprocess on 127.0.0.1, started and killed here.

Usage: python benchmarks/bench_server.py [--requests 1000] [--clients 64] [--max-tokens 8] [--skip-llamacpp]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import load_rag, rag_messages

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_server.md"
KEY = "bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(command: list[str], health: str, timeout: float = 300) -> Iterator[subprocess.Popen]:
    """Start a server subprocess, wait (bounded) until `health` answers 200, always stop it."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[:4]} exited with {process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(health, timeout=5, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[:4]} did not become healthy in {timeout} s")
            time.sleep(0.5)
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024  # type: ignore[union-attr]


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def question(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {i}: what is {i % 97} plus {(i * 7) % 89}?"}]


async def load(base: str, model: str, requests: int, clients: int, max_tokens: int) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEY}"}
    results: dict[int, tuple[float, dict[str, Any]]] = {}
    todo = iter(range(requests))

    async def client(http: httpx.AsyncClient) -> None:
        for i in todo:
            t0 = time.perf_counter()
            response = await http.post("/v1/chat/completions", json={
                "model": model, "messages": question(i), "max_tokens": max_tokens, "temperature": 0})
            results[i] = (time.perf_counter() - t0, response.json() if response.status_code == 200 else
                          {"status": response.status_code, "body": response.text})

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    wall = time.perf_counter() - t0
    answered = [r for _, r in results.values() if "choices" in r and r["choices"][0]["finish_reason"]]
    latencies = sorted(t for t, _ in results.values())
    tokens = sum(r["usage"]["completion_tokens"] for r in answered)
    # a greedy subset, asked again alone: the same text (no mix-ups between concurrent requests)
    subset = list(range(0, requests, 20))
    mismatched = 0
    with httpx.Client(base_url=base, headers=headers, timeout=600) as http:
        for i in subset:
            alone = http.post("/v1/chat/completions", json={
                "model": model, "messages": question(i), "max_tokens": max_tokens, "temperature": 0}).json()
            mismatched += alone["choices"][0]["message"]["content"] != results[i][1]["choices"][0]["message"]["content"]
    return {"requests": requests, "clients": clients, "answered": len(answered), "lost": requests - len(answered),
            "checked": len(subset), "mismatched": mismatched, "wall_s": wall, "req_per_s": requests / wall,
            "tokens_per_s": tokens / wall, "p50_s": latencies[len(latencies) // 2],
            "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


async def disconnects(base: str, model: str, requests: int, clients: int, max_tokens: int) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {KEY}"}
    todo = iter(range(requests))
    outcome = {"completed": 0, "hung_up": 0}

    async def client(http: httpx.AsyncClient) -> None:
        for i in todo:
            body = {"model": model, "messages": question(10_000 + i), "max_tokens": max_tokens, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and i % 5 == 0:  # every fifth client hangs up mid-stream
                        outcome["hung_up"] += 1
                        break
                    if line == "data: [DONE]":
                        outcome["completed"] += 1

    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600,
                                 limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return outcome


def batch_seconds(base_url: str, model: str, api_key: str, max_tokens: int, kev_client: bool = False) -> tuple[
    float, list[str]
]:
    """Wall time of one `batch()` of the 16 RAG chats through ChatOpenAI (concurrent requests that
    coalesce on a Kev server) or through ChatKev(base_url=...) (the batch in ONE request)."""
    if kev_client:
        from kev_integrations.langchain import ChatKev

        llm: Any = ChatKev(base_url=base_url, api_key=api_key, max_tokens=max_tokens, temperature=0)
    else:
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=model, max_tokens=max_tokens, temperature=0,
                         max_retries=0, timeout=1200)
    messages = [[(m["role"], m["content"]) for m in rag_messages(item)] for item in load_rag()]
    llm.invoke(messages[0])  # warm-up
    t0 = time.perf_counter()
    replies = llm.batch(messages, config={"max_concurrency": len(messages)})
    return time.perf_counter() - t0, [r.content for r in replies]


def wait_idle(base: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while metric(base, "kev_running_requests") or metric(base, "kev_queued_questions"):
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become idle")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rag-max-tokens", type=int, default=32)
    ap.add_argument("--stream-requests", type=int, default=200, help="streamed requests in the disconnect run")
    ap.add_argument("--skip-llamacpp", action="store_true")
    args = ap.parse_args()
    from kev_engine import loader

    model = loader.EMBEDDED_NAME
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kev_engine", "serve", "--port", str(port), "--api-key", KEY,
               "--max-queued", str(max(1024, args.clients * 4))]
    lines = [f"# bench_server (embedded model, fp32, {os.cpu_count()} CPUs)", ""]
    with server(command, base + "/health") as process:
        print("--- load", flush=True)
        result = asyncio.run(load(base, model, args.requests, args.clients, args.max_tokens))
        lines += [
            f"## Load: {result['requests']} chat requests from {result['clients']} concurrent clients, "
            f"max_tokens={args.max_tokens}, greedy",
            "", "| answered | lost | mismatched (of checked) | wall s | req/s | tokens/s | p50 s | p99 s |",
            "|---|---|---|---|---|---|---|---|",
            f"| {result['answered']} | {result['lost']} | {result['mismatched']} of {result['checked']} | "
            f"{result['wall_s']:.1f} | {result['req_per_s']:.2f} | {result['tokens_per_s']:.1f} | "
            f"{result['p50_s']:.2f} | {result['p99_s']:.2f} |", "",
        ]
        print("--- disconnect", flush=True)
        wait_idle(base)
        lines += [
            f"## Disconnects: {args.stream_requests} streamed requests (max_tokens=48), every fifth client hangs up "
            "after its first chunk; the same run three times",
            "", "| run | completed | hung up | engine requests cancelled | RSS before MiB | RSS after (idle) MiB | "
            "KV in use after | KV kept for reuse after (LRU prefix cache) |", "|---|---|---|---|---|---|---|---|",
        ]
        for run in range(3):
            rss_before, cancelled_before = rss_mib(process.pid), metric(base, "kev_cancelled_total")
            outcome = asyncio.run(disconnects(base, model, args.stream_requests, args.clients, 48))
            wait_idle(base)
            cancelled = metric(base, "kev_cancelled_total") - cancelled_before
            lines.append(
                f"| {run + 1} | {outcome['completed']} | {outcome['hung_up']} | {cancelled:.0f} | {rss_before:.0f} | "
                f"{rss_mib(process.pid):.0f} | {metric(base, 'kev_kv_cache_bytes'):.0f} | "
                f"{metric(base, 'kev_kv_cached_prefix_bytes') / 2**20:.0f} MiB |")
        lines.append("")
        print("--- side by side: kev serve", flush=True)
        kev_s, kev_texts = batch_seconds(base + "/v1", model, KEY, args.rag_max_tokens)
        print("--- side by side: ChatKev(base_url=...) against kev serve", flush=True)
        client_s, client_texts = batch_seconds(base, model, KEY, args.rag_max_tokens, kev_client=True)
    same = sum(a == b for a, b in zip(kev_texts, client_texts))
    rows = [f"| ChatOpenAI → kev serve (16 concurrent requests, coalesced) | {kev_s:.2f} | 1.00 |",
            f"| ChatKev(base_url=...) → kev serve (the batch in one request; {same}/16 answers identical to "
            f"ChatOpenAI's) | {client_s:.2f} | {client_s / kev_s:.2f} |"]
    if not args.skip_llamacpp and importlib.util.find_spec("llama_cpp") and importlib.util.find_spec("sse_starlette"):
        print("--- side by side: llama.cpp server", flush=True)
        lport = free_port()
        lcommand = [sys.executable, "-m", "llama_cpp.server", "--model", str(loader.embedded_gguf()), "--port",
                    str(lport), "--n_ctx", "8192", "--model_alias", model]
        with server(lcommand, f"http://127.0.0.1:{lport}/v1/models"):
            llama_s, _ = batch_seconds(f"http://127.0.0.1:{lport}/v1", model, "none", args.rag_max_tokens)
        rows.append(f"| ChatOpenAI → llama.cpp server (llama-cpp-python, same GGUF) | {llama_s:.2f} | "
                    f"{llama_s / kev_s:.2f} |")
    else:
        rows.append("| llama.cpp server | not installed (pip install 'llama-cpp-python[server]') | |")
    lines += [f"## ChatOpenAI.batch() of the 16 RAG questions (max_tokens={args.rag_max_tokens}, greedy)", "",
              "| server | wall s | time / kev's |", "|---|---|---|", *rows, ""]
    md = "\n".join(lines)
    RESULTS_MD.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_MD.write_text(md)
    print(md)


if __name__ == "__main__":
    main()
