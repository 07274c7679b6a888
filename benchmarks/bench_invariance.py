"""Batch invariance: what it costs, and Kev beside llama.cpp's server with parallel slots.

For each dtype (float32, bfloat16) and workload (RAG-16: 16 questions with their own contexts,
48 new tokens; DOC-QA: 20 questions about one ~1,500-token document, 32 new tokens; "one": the
first RAG-16 question alone, 17 new tokens), in one run:

* ``kev``          - one ``Engine.generate`` over all questions, batch-invariant (the default)
* ``kev_blas``     - the same with ``batch_invariant=False``: torch's BLAS and attention kernels
* ``llama_server`` - llama.cpp's ``llama-server -np N -kvu`` (N slots, one unified KV buffer),
                     every question sent at once as the same prompt ids, greedy, from a GGUF of
                     the same precision converted from the embedded model (see docs/benchmarks.md)

Every system runs in its own process, each timed run with fresh prefix-cache keys (Kev: a new
``cache_salt``; llama-server: ``cache_prompt`` off), best of ``--repeat``. After the timing, each
Kev system is checked the way `kev verify --exact` does it: all questions packed, then each alone,
comparing the logits every token was sampled from with ``torch.equal``.

Usage: python benchmarks/bench_invariance.py [--repeat 2] [--dtype float32 bfloat16]
           [--workload rag16 docqa one] [--llama-server PATH --gguf-dir DIR]
       DIR holds SmolLM2-135M-Instruct-f32.gguf and SmolLM2-135M-Instruct-bf16.gguf.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefix import doc_qa_messages  # noqa: E402
from workload import load_rag, rag_messages  # noqa: E402

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_invariance.md"
WORKLOADS = {"rag16": ("RAG-16", 48), "docqa": ("DOC-QA", 32), "one": ("1 question", 17)}
GGUF = {"float32": "SmolLM2-135M-Instruct-f32.gguf", "bfloat16": "SmolLM2-135M-Instruct-bf16.gguf"}
CORES = len(os.sched_getaffinity(0))
WARM_UP = [{"role": "user", "content": "Say hello."}]


def messages(workload: str) -> list[Any]:
    if workload == "one":  # one RAG question alone (its own passage): the latency of a lone request
        return [rag_messages(load_rag()[0])]
    return [rag_messages(item) for item in load_rag()] if workload == "rag16" else doc_qa_messages()


def kev_worker(data: dict) -> dict:
    """Time Kev on the workload in this process, then check packed == alone bitwise."""
    import torch

    from kev_engine import Engine, SamplingParams
    from kev_engine.tools.verify import verify

    torch.set_num_threads(CORES)
    engine = Engine.from_pretrained(dtype=data["dtype"], batch_invariant=data["invariant"])
    msgs, max_tokens = messages(data["workload"]), data["max_tokens"]
    engine.generate([WARM_UP], SamplingParams(temperature=0, max_tokens=max_tokens))
    walls, generated = [], 0
    for run in range(data["repeat"]):
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=f"run-{run}")
        started = time.perf_counter()
        answers = engine.generate(msgs, sampling)
        walls.append(time.perf_counter() - started)
        generated = sum(a.completion_tokens for a in answers)
    rows = verify(engine, msgs, [None] * len(msgs), max_tokens, bitwise=True)
    stats = engine.stats()
    engine.close()
    return {"wall_s": min(walls), "walls": walls, "generated": generated, "dtype": stats["dtype"],
            "batch_invariant": stats["batch_invariant"], "bitwise_equal_alone": sum(r["ok"] for r in rows),
            "tokens_equal_alone": sum(r["tokens_match"] for r in rows), "questions": len(rows),
            "max_logit_diff": max(r["max_logit_diff"] for r in rows)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def llama_server_run(binary: str, gguf: Path, prompts: list[list[int]], max_tokens: int, repeat: int) -> dict:
    """llama-server with one slot per question and a unified KV buffer; every request at once."""
    port = free_port()
    context = sum(len(p) + max_tokens for p in prompts) + 256
    command = [binary, "-m", str(gguf), "-np", str(len(prompts)), "-kvu", "-c", str(context), "-t", str(CORES),
               "-tb", str(CORES), "--host", "127.0.0.1", "--port", str(port), "--no-webui", "-lv", "0"]
    shown = " ".join([gguf.name, *command[3:-7]])  # the report's: without the folder and the port
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # /health is 503 while the model loads
            if server.poll() is not None:
                raise RuntimeError(f"llama-server exited {server.returncode}: {server.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become ready in 120 s")
            time.sleep(0.2)

        def ask(ids: list[int], out: list, i: int) -> None:
            out[i] = post(base + "/completion", {"prompt": ids, "n_predict": max_tokens, "temperature": 0,
                                                 "top_k": 1, "cache_prompt": False, "return_tokens": True})

        ask(prompts[0][:16], [None], 0)  # warm-up
        walls, generated = [], 0
        for _ in range(repeat):
            results: list[Any] = [None] * len(prompts)
            threads = [threading.Thread(target=ask, args=(p, results, i)) for i, p in enumerate(prompts)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            walls.append(time.perf_counter() - started)
            generated = sum(len(r.get("tokens", [])) or r.get("tokens_predicted", 0) for r in results)
        return {"wall_s": min(walls), "walls": walls, "generated": generated, "command": shown}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def run_worker(name: str, data: dict) -> dict:
    """`name` in its own process; a failure is reported, not raised."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps(data))
        rc = subprocess.call([sys.executable, os.path.abspath(__file__), "--worker", str(inp), str(out)])
        return json.loads(out.read_text()) if rc == 0 else {"skipped": f"{name}: worker exit code {rc}"}


def prompt_ids(workload: str) -> list[list[int]]:
    from kev_engine import Engine

    engine = Engine.from_pretrained(dtype="float32", cpu_kernels="torch")  # only its tokenizer's ids
    ids = [engine.encode(m) for m in messages(workload)]
    engine.close()
    return ids


def report(rows: list[dict], repeat: int) -> str:
    import platform

    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    lines = [f"# bench_invariance: batch-invariant Kev vs torch's kernels vs llama-server ({CORES} cores, {cpu}, "
             f"torch {torch.__version__}, {platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "", f"Wall = best of {repeat} timed run(s) after a warm-up; every system in its own process.", "",
             "| dtype | workload | system | wall s | new tokens | vs kev_blas | vs llama-server | "
             "bitwise = alone | tokens = alone |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        res = row["results"]
        blas, llama = res.get("kev_blas", {}), res.get("llama_server", {})
        for name in ("kev", "kev_blas", "llama_server"):
            r = res.get(name)
            if r is None:
                continue
            if "skipped" in r:
                lines.append(f"| {row['dtype']} | {row['workload']} | {name} | {r['skipped']} | | | | | |")
                continue
            vs_blas = f"{r['wall_s'] / blas['wall_s']:.2f}x" if "wall_s" in blas and name != "kev_blas" else ""
            vs_llama = f"{r['wall_s'] / llama['wall_s']:.2f}x" if "wall_s" in llama and name != "llama_server" else ""
            exact = f"{r['bitwise_equal_alone']}/{r['questions']}" if "questions" in r else "n/a"
            tokens = f"{r['tokens_equal_alone']}/{r['questions']}" if "questions" in r else "n/a"
            lines.append(f"| {row['dtype']} | {row['workload']} | {name} | {r['wall_s']:.2f} | {r['generated']} | "
                         f"{vs_blas} | {vs_llama} | {exact} | {tokens} |")
    servers = [r["results"].get("llama_server", {}) for r in rows]
    commands = {s["command"] for s in servers if "command" in s}
    if commands:
        lines += ["", "llama-server arguments: " + "; ".join(sorted(commands))]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=list(GGUF))
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--llama-server", dest="llama_server", help="path of a llama-server binary (else skipped)")
    ap.add_argument("--gguf-dir", dest="gguf_dir", help="folder with the f32 and bf16 GGUFs of the embedded model")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        data = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(kev_worker(data)))
        return
    rows = []
    for dtype in args.dtype:
        for workload in args.workload:
            title, max_tokens = WORKLOADS[workload]
            base = {"dtype": dtype, "workload": workload, "max_tokens": max_tokens, "repeat": args.repeat}
            results: dict[str, dict] = {}
            for name, invariant in (("kev", True), ("kev_blas", False)):
                print(f"--- {dtype} {title} {name}", flush=True)
                results[name] = run_worker(name, {**base, "invariant": invariant})
                print(json.dumps(results[name]), flush=True)
            if args.llama_server and args.gguf_dir:
                print(f"--- {dtype} {title} llama_server", flush=True)
                try:
                    results["llama_server"] = llama_server_run(args.llama_server, Path(args.gguf_dir) / GGUF[dtype],
                                                               prompt_ids(workload), max_tokens, args.repeat)
                except (OSError, RuntimeError) as exc:
                    results["llama_server"] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
                print(json.dumps(results["llama_server"]), flush=True)
            else:
                results["llama_server"] = {"skipped": "no --llama-server and --gguf-dir given"}
            rows.append({"dtype": dtype, "workload": title, "results": results})
    md = report(rows, args.repeat)
    RESULTS_MD.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_MD.write_text(md)
    RESULTS_MD.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n" + md)


if __name__ == "__main__":
    main()
