"""Load test of `kev serve` on loopback, and ChatOpenAI.batch() against kev serve vs llama.cpp's server.

1. ``load``: N chat requests (greedy, short answers) from C concurrent clients, of which 10 %
   disconnect (half hang up a stream after its first event, half give up on a plain request
   after 0.3 s) and 5 % are malformed bodies (answered 400). The same load runs twice on one
   server, each with prompts of its own: alone, then beside a few large JSON schemas (1,000+
   optional properties, seconds of compile each) sent by other tenants (keys). Reported per
   run: lost (no answer, or an answer without a finish reason), hung (no answer within
   ``--hang-s``), 5xx, a plain request's p50/p99, the slowest /health while it ran, and the
   large schemas' answers; none mismatched (every 20th plain prompt, asked again alone
   afterwards, gets the same text); RSS and KV once idle.
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
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import load_rag, rag_messages

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_server.md"
KEY = "bench"
LARGE_TENANTS = [f"tenant-{i}" for i in range(6)]  # each sends one large schema, then the same one again
MALFORMED: list[bytes] = [
    b'{"model": "x", "messages": [{"role": "user", "content": "cut off',  # truncated JSON
    b'[{"role": "user", "content": "a list, not an object"}]',
    b'{"model": "%(model)s", "messages": "not a list", "max_tokens": 4}',
    b'{"model": "%(model)s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "frobnicate": 1}',
]


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


def large_schema(i: int) -> dict[str, Any]:
    """~25 kB, 1,000+ optional properties: compiles for several seconds (under the 100 kB cap)."""
    return {"type": "object", "properties": {f"p{i}_{j}": {"type": "string"} for j in range(1000 + 50 * i)}}


def kind(i: int) -> str:
    if i % 10 == 3:
        return "hang_up_stream" if (i // 10) % 2 == 0 else "give_up"
    return "malformed" if i % 20 == 7 else "plain"


@dataclass
class Outcomes:
    """What one load run's requests got."""

    plain_latency: list[float] = field(default_factory=list)
    answers: dict[int, str] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    large: list[tuple[str, int, float, str]] = field(default_factory=list)  # tenant, status, seconds, error
    health_max_s: float = 0.0
    wall_s: float = 0.0


async def load(base: str, model: str, requests: int, clients: int, max_tokens: int, offset: int,
               with_large: bool, hang_s: float) -> Outcomes:
    """One run of the mixed load; prompts `offset + i` so two runs never share a prompt's KV."""
    out = Outcomes()
    todo = iter(range(requests))
    done = asyncio.Event()

    def chat_body(i: int, **extra: Any) -> dict[str, Any]:
        return {"model": model, "messages": question(offset + i), "max_tokens": max_tokens, "temperature": 0, **extra}

    async def one(http: httpx.AsyncClient, i: int) -> None:
        what = kind(i)
        t0 = time.perf_counter()
        if what == "hang_up_stream":
            async with http.stream("POST", "/v1/chat/completions", json=chat_body(i, stream=True)) as response:
                out.statuses[response.status_code] += 1
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # leaving the block closes the connection mid-stream
            out.counts["disconnected"] += 1
            return
        if what == "give_up":
            try:
                response = await asyncio.wait_for(http.post("/v1/chat/completions", json=chat_body(i)), 0.3)
                out.statuses[response.status_code] += 1
                out.counts["answered before the client left"] += 1
            except asyncio.TimeoutError:
                out.counts["disconnected"] += 1
            return
        if what == "malformed":
            raw = MALFORMED[(i // 20) % len(MALFORMED)] % {b"model": model.encode()}
            response = await http.post("/v1/chat/completions", content=raw,
                                       headers={"Content-Type": "application/json"})
            out.statuses[response.status_code] += 1
            out.counts["malformed answered 400" if response.status_code == 400 else "malformed NOT 400"] += 1
            return
        response = await http.post("/v1/chat/completions", json=chat_body(i))
        out.statuses[response.status_code] += 1
        body = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        if response.status_code == 200 and body.get("choices") and body["choices"][0].get("finish_reason"):
            out.plain_latency.append(time.perf_counter() - t0)
            out.answers[i] = body["choices"][0]["message"]["content"]
            out.counts["plain answered"] += 1
        else:
            out.counts["lost"] += 1

    async def client(http: httpx.AsyncClient) -> None:
        for i in todo:
            try:
                await asyncio.wait_for(one(http, i), hang_s)
            except asyncio.TimeoutError:
                out.counts["hung"] += 1
            except httpx.TransportError:
                out.counts["lost"] += 1

    async def large(tenant: str, i: int) -> None:
        headers = {"Authorization": f"Bearer {tenant}"}
        body = chat_body(0, response_format={"type": "json_schema", "json_schema": {
            "name": "big", "schema": large_schema(i)}})
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=hang_s) as http:
            for _ in range(2):  # the same schema twice: compiled (or refused), then from the cache
                t0 = time.perf_counter()
                try:
                    response = await http.post("/v1/chat/completions", json=body)
                    error = ""
                    if response.status_code != 200:
                        with contextlib.suppress(ValueError, KeyError, TypeError):
                            refusal = response.json()["error"]
                            error = f"{refusal['code'] or ''}: {refusal['message'][:90]}"
                    out.large.append((tenant, response.status_code, time.perf_counter() - t0, error))
                except httpx.TransportError as exc:
                    out.large.append((tenant, 0, time.perf_counter() - t0, type(exc).__name__))

    async def health(http: httpx.AsyncClient) -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await http.get("/health")
            out.health_max_s = max(out.health_max_s, time.perf_counter() - t0)
            await asyncio.sleep(0.25)

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=clients + 1)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=hang_s, limits=limits) as http:
        prober = asyncio.ensure_future(health(http))
        extra = [large(tenant, i) for i, tenant in enumerate(LARGE_TENANTS)] if with_large else []
        await asyncio.gather(*(client(http) for _ in range(clients)), *extra)
        done.set()
        await prober
    out.wall_s = time.perf_counter() - t0
    return out


def mismatched(base: str, model: str, out: Outcomes, offset: int, max_tokens: int) -> tuple[int, int]:
    """(mismatched, checked): every 20th plain answer against the same prompt asked alone."""
    checked = [i for i in sorted(out.answers) if i % 20 == 0]
    wrong = 0
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as http:
        for i in checked:
            alone = http.post("/v1/chat/completions", json={
                "model": model, "messages": question(offset + i), "max_tokens": max_tokens, "temperature": 0}).json()
            wrong += alone["choices"][0]["message"]["content"] != out.answers[i]
    return wrong, len(checked)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


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


def wait_idle(base: str, timeout: float = 300) -> None:
    """Until nothing runs, waits or compiles (a compile past its budget runs on in the background)."""
    deadline = time.monotonic() + timeout
    while (metric(base, "kev_running_requests") or metric(base, "kev_queued_questions")
           or metric(base, "kev_grammar_compiles_in_flight")):
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become idle")
        time.sleep(0.2)


def load_rows(name: str, out: Outcomes, requests: int, wrong: int, checked: int) -> str:
    fivexx = sum(n for status, n in out.statuses.items() if status >= 500)
    return (f"| {name} | {out.counts['plain answered']} | {out.counts['lost']} | {out.counts['hung']} | {fivexx} | "
            f"{out.counts['disconnected']} | {out.counts['malformed answered 400']} "
            f"(not 400: {out.counts['malformed NOT 400']}) | {wrong} of {checked} | {out.wall_s:.1f} | "
            f"{quantile(out.plain_latency, 0.5):.2f} | {quantile(out.plain_latency, 0.99):.2f} | "
            f"{out.health_max_s:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--hang-s", type=float, default=300, help="a request unanswered this long counts as hung")
    ap.add_argument("--rag-max-tokens", type=int, default=32)
    ap.add_argument("--stream-requests", type=int, default=200, help="streamed requests in the disconnect run")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the served engine's dtype")
    args = ap.parse_args()
    from kev_engine import loader

    model = loader.EMBEDDED_NAME
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kev_integrations", "serve", "--port", str(port), "--api-key", KEY,
               "--max-queued", str(max(1024, args.clients * 4)), "--dtype", args.dtype]
    for tenant in LARGE_TENANTS:
        command += ["--api-key", tenant]
    lines = [f"# bench_server (embedded model, {args.dtype}, batch-invariant, {os.cpu_count()} CPUs)", ""]
    with server(command, base + "/health") as process:
        runs = []
        for name, offset, with_large in (("alone", 0, False), ("beside large schemas", 100_000, True)):
            print(f"--- load: {name}", flush=True)
            out = asyncio.run(load(base, model, args.requests, args.clients, args.max_tokens, offset, with_large,
                                   args.hang_s))
            wait_idle(base)
            runs.append((name, out, *mismatched(base, model, out, offset, args.max_tokens), rss_mib(process.pid),
                         metric(base, "kev_kv_cache_bytes")))
        kinds = Counter(kind(i) for i in range(args.requests))
        lines += [
            f"## Load: {args.requests} chat requests from {args.clients} concurrent clients, max_tokens="
            f"{args.max_tokens}, greedy: {kinds['plain']} plain, {kinds['hang_up_stream'] + kinds['give_up']} "
            "disconnecting (half hang up a stream after its first event, half give up after 0.3 s), "
            f"{kinds['malformed']} malformed bodies",
            "",
            "The same load twice on one server, each run with prompts of its own: alone, then while "
            f"{len(LARGE_TENANTS)} other tenants each send a large JSON schema (1,000-1,250 optional properties, "
            "25-31 kB) twice.",
            "",
            "| run | plain answered | lost | hung | 5xx | disconnected | malformed → 400 | mismatched (of checked) | "
            "wall s | plain p50 s | plain p99 s | slowest /health s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *(load_rows(name, out, args.requests, wrong, checked) for name, out, wrong, checked, _, _ in runs), "",
            f"Plain p50 beside the large schemas / alone: "
            f"{quantile(runs[1][1].plain_latency, 0.5) / quantile(runs[0][1].plain_latency, 0.5):.2f}x. "
            f"Once idle after each run: RSS {runs[0][4]:.0f} / {runs[1][4]:.0f} MiB, KV in use "
            f"{runs[0][5]:.0f} / {runs[1][5]:.0f} bytes.",
            "",
            "The large schemas' answers, each tenant's two in the order sent:",
            "",
            "| tenant | status | s | error (code: message) |", "|---|---|---|---|",
            *(f"| {t} | {status} | {sec:.1f} | {error} |"
              for t, status, sec, error in sorted(runs[1][1].large, key=lambda row: row[0])), "",
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
