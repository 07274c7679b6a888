"""Batch invariance: what it costs, and Kev beside llama.cpp's server with parallel slots.

For each dtype (float32, bfloat16) and workload (RAG-16: 16 questions with their own contexts,
48 new tokens; DOC-QA: 20 questions about one ~1,500-token document, 32 new tokens; "one": the
first RAG-16 question alone, 17 new tokens; Q-64: the RAG-16 questions four times, each copy's
system prompt opening with its own number so no two share a prefix, 32 new tokens), in one run:

* ``kev``          - one ``Engine.generate`` over all questions, batch-invariant (the default)
* ``kev_no_amx``   - bfloat16 on a CPU with AMX: the same, run as a CPU without AMX runs it
                     (``KEV_CPU_ISA=no-amx``: oneDNN capped to match; Kev's bf16 products on the
                     path measured faster here, AVX512-BF16 or fused multiply-adds)
* ``kev_no_amx_dp`` - the same with the AVX512-BF16 path forced (``KEV_BF16_PATH=avx512_bf16``)
* ``kev_blas``     - the same with ``batch_invariant=False``: torch's BLAS and attention kernels
* ``llama_server`` - llama.cpp's ``llama-server -np N -kvu`` (N slots, one unified KV buffer),
                     every question sent at once as the same prompt ids, greedy, from a GGUF of
                     the same precision converted from the model (see docs/benchmarks.md)

Models: the embedded SmolLM2-135M-Instruct (its GGUFs in --gguf-dir), or with ``--model
llama-0.7b`` a 0.7B-parameter Llama of random weights on the embedded tokenizer, built in
``--model-dir`` (`random_models`; its GGUFs are converted there when ``--convert`` names
llama.cpp's convert_hf_to_gguf.py). Random weights run every answer to max_tokens, alike for all.

Every system runs in its own process, each timed run with fresh prefix-cache keys (Kev: a new
``cache_salt``; llama-server: ``cache_prompt`` off), best of ``--repeat``. After the timing, each
Kev system is checked the way `kev verify --bitwise` does it: all questions packed, then each alone,
comparing the logits every token was sampled from with ``torch.equal``.

Usage: python benchmarks/bench_invariance.py [--repeat 2] [--dtype float32 bfloat16]
           [--workload rag16 docqa one q64] [--systems kev kev_no_amx kev_no_amx_dp kev_blas llama_server]
           [--llama-server PATH --gguf-dir DIR] [--model embedded|llama-0.7b --model-dir DIR
           --convert convert_hf_to_gguf.py] [--no-verify]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefix import doc_qa_messages  # noqa: E402
from workload import load_rag, rag_messages  # noqa: E402

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_invariance.md"
WORKLOADS = {"rag16": ("RAG-16", 48), "docqa": ("DOC-QA", 32), "one": ("1 question", 17), "q64": ("Q-64", 32)}
GGUF = {"float32": "SmolLM2-135M-Instruct-f32.gguf", "bfloat16": "SmolLM2-135M-Instruct-bf16.gguf"}
GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16"}
SYSTEMS = ("kev", "kev_no_amx", "kev_no_amx_dp", "kev_blas", "llama_server")
NO_AMX = ("kev_no_amx", "kev_no_amx_dp")
ENV = {"kev_no_amx_dp": {"KEV_BF16_PATH": "avx512_bf16"}}  # a system's own environment
MODELS = ("embedded", "llama-0.7b")  # the latter a random_models shape
CORES = len(os.sched_getaffinity(0))
WARM_UP = [{"role": "user", "content": "Say hello."}]


def messages(workload: str) -> list[Any]:
    if workload == "one":  # one RAG question alone (its own passage): the latency of a lone request
        return [rag_messages(load_rag()[0])]
    if workload == "q64":  # four numbered copies: from their first words on, no prefix is shared
        return [[{**m, "content": f"[{copy}] {m['content']}"} if m["role"] == "system" else m
                 for m in rag_messages(item)] for copy in range(4) for item in load_rag()]
    return [rag_messages(item) for item in load_rag()] if workload == "rag16" else doc_qa_messages()


def build_model(name: str, folder: Path, convert: str | None) -> Path:
    """The random-weight model `name` in `folder` (built once), and its GGUFs when `convert` is given."""
    import random_models

    from kev_engine import loader

    if not (folder / "config.json").exists():
        embedded = loader.converted_gguf_dir(loader.embedded_gguf())
        if not (embedded / "config.json").exists():
            prompt_ids("one")  # loading the embedded model converts it: its config and tokenizer files
        random_models.build(embedded, name, folder, device="cpu", dtype=torch_dtype("bfloat16"))
    for kind in GGUF_TYPE.values():
        gguf = folder / f"{name}-{kind}.gguf"
        if convert and not gguf.exists():
            command = [sys.executable, convert, str(folder), "--outtype", kind, "--outfile", str(gguf)]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return folder


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def kev_worker(data: dict) -> dict:
    """Time Kev on the workload in this process, then check packed == alone bitwise."""
    import torch

    from kev_engine import Engine, SamplingParams
    from kev_engine.platforms.cpu import kernels
    from kev_engine.tools.verify import verify

    torch.set_num_threads(CORES)
    engine = Engine.from_pretrained(data.get("model"), dtype=data["dtype"], batch_invariant=data["invariant"])
    msgs, max_tokens = messages(data["workload"]), data["max_tokens"]
    engine.generate([WARM_UP], SamplingParams(temperature=0, max_tokens=max_tokens))
    walls, generated = [], 0
    for run in range(data["repeat"]):
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=f"run-{run}")
        started = time.perf_counter()
        answers = engine.generate(msgs, sampling)
        walls.append(time.perf_counter() - started)
        generated = sum(a.completion_tokens for a in answers)
    stats = engine.stats()
    result = {"wall_s": min(walls), "walls": walls, "generated": generated, "dtype": stats["dtype"],
              "batch_invariant": stats["batch_invariant"], "paths": kernels.load_kernels().linear_paths}
    if data.get("verify", True):
        rows = verify(engine, msgs, [None] * len(msgs), max_tokens, bitwise=True)
        result |= {"bitwise_equal_alone": sum(r["ok"] for r in rows), "questions": len(rows),
                   "tokens_equal_alone": sum(r["tokens_match"] for r in rows),
                   "max_logit_diff": max(r["max_logit_diff"] for r in rows)}
    engine.close()
    return result


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


def run_worker(name: str, data: dict, isa: str = "native", env: dict[str, str] | None = None,
               script: str = __file__) -> dict:
    """`name` in its own process (`script --worker IN OUT`: `answer_worker`), as a CPU of
    instruction set `isa` (KEV_CPU_ISA) would run it; a failure is reported, not raised."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps(data))
        command = [sys.executable, os.path.abspath(script), "--worker", str(inp), str(out)]
        if isa != "native":  # torch's own dispatch is capped at its start: the isa runner sets it
            command = [sys.executable, "-m", "kev_engine.platforms.cpu.isa", isa, "--", *command]
        rc = subprocess.call(command, env={**os.environ, **(env or {})})
        return json.loads(out.read_text()) if rc == 0 else {"skipped": f"{name}: worker exit code {rc}"}


def answer_worker(paths: list[str], work: Callable[[dict], dict]) -> None:
    """A worker process's whole job: `work` on the JSON at paths[0], its result to paths[1]."""
    Path(paths[1]).write_text(json.dumps(work(json.loads(Path(paths[0]).read_text()))))


def prompt_ids(workload: str, model: str | None = None) -> list[list[int]]:
    from kev_engine import Engine

    engine = Engine.from_pretrained(model, dtype="float32", cpu_kernels="torch")  # only its tokenizer's ids
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
             "| model | dtype | workload | system | kernels | wall s | new tokens | vs kev_blas | vs llama-server | "
             "vs kev float32 | bitwise = alone | tokens = alone |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fp32 = {(r["model"], r["workload"]): r["results"].get("kev", {}) for r in rows if r["dtype"] == "float32"}
    for row in rows:
        res = row["results"]
        blas, llama = res.get("kev_blas", {}), res.get("llama_server", {})
        own32 = fp32.get((row["model"], row["workload"]), {})
        for name in SYSTEMS:
            r = res.get(name)
            if r is None:
                continue
            head = f"| {row['model']} | {row['dtype']} | {row['workload']} | {name} |"
            if "skipped" in r:
                lines.append(f"{head} | {r['skipped']} | | | | | | | |")
                continue
            vs_blas = f"{r['wall_s'] / blas['wall_s']:.2f}x" if "wall_s" in blas and name != "kev_blas" else ""
            vs_llama = f"{r['wall_s'] / llama['wall_s']:.2f}x" if "wall_s" in llama and name != "llama_server" else ""
            vs_fp32 = (f"{r['wall_s'] / own32['wall_s']:.2f}x" if "wall_s" in own32 and name.startswith("kev")
                       and row["dtype"] != "float32" else "")
            exact = f"{r['bitwise_equal_alone']}/{r['questions']}" if "questions" in r else "n/a"
            tokens = f"{r['tokens_equal_alone']}/{r['questions']}" if "questions" in r else "n/a"
            paths = r.get("paths", "llama.cpp")
            lines.append(f"{head} {paths} | {r['wall_s']:.2f} | {r['generated']} | {vs_blas} | {vs_llama} | "
                         f"{vs_fp32} | {exact} | {tokens} |")
    servers = [r["results"].get("llama_server", {}) for r in rows]
    commands = {s["command"] for s in servers if "command" in s}
    if commands:
        lines += ["", "llama-server arguments: " + "; ".join(sorted(commands))]
    return "\n".join(lines) + "\n"


def write_report(path: str, md: str, rows: list[dict]) -> None:
    """The report at `path` (.md), its raw rows beside it (.json), and the report on stdout."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n" + md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=list(GGUF))
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--llama-server", dest="llama_server", help="path of a llama-server binary (else skipped)")
    ap.add_argument("--gguf-dir", dest="gguf_dir", help="folder with the f32 and bf16 GGUFs of the embedded model")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS,
                    help="kev_no_amx and kev_no_amx_dp run only for bfloat16 on a CPU with AMX")
    ap.add_argument("--model", default="embedded", choices=MODELS)
    ap.add_argument("--model-dir", dest="model_dir", help="where a random-weight --model is built (and reused)")
    ap.add_argument("--convert", help="llama.cpp's convert_hf_to_gguf.py: GGUFs of a random-weight --model")
    ap.add_argument("--no-verify", dest="verify", action="store_false", help="skip the packed == alone check")
    ap.add_argument("--out", default=str(RESULTS_MD), help="the report's path (.md; its .json beside it)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        answer_worker(args.worker, kev_worker)
        return
    model, gguf_dir, gguf_name = None, args.gguf_dir, GGUF
    if args.model != "embedded":
        if not args.model_dir:
            ap.error(f"--model {args.model} needs --model-dir")
        model = str(build_model(args.model, Path(args.model_dir), args.convert))
        gguf_dir, gguf_name = args.model_dir, {d: f"{args.model}-{k}.gguf" for d, k in GGUF_TYPE.items()}
    from kev_engine.platforms.cpu.isa import cpu_flags

    has_amx = "amx_bf16" in cpu_flags("native")
    rows = []
    for dtype in args.dtype:
        for workload in args.workload:
            title, max_tokens = WORKLOADS[workload]
            base = {"dtype": dtype, "workload": workload, "max_tokens": max_tokens, "repeat": args.repeat,
                    "model": model, "verify": args.verify}
            results: dict[str, dict] = {}
            for name, invariant, isa in (("kev", True, "native"), ("kev_no_amx", True, "no-amx"),
                                         ("kev_no_amx_dp", True, "no-amx"), ("kev_blas", False, "native")):
                if name not in args.systems or (name in NO_AMX and (dtype != "bfloat16" or not has_amx)):
                    continue
                print(f"--- {args.model} {dtype} {title} {name}", flush=True)
                results[name] = run_worker(name, {**base, "invariant": invariant}, isa, ENV.get(name))
                print(json.dumps(results[name]), flush=True)
            if "llama_server" not in args.systems:
                pass
            elif args.llama_server and gguf_dir:
                print(f"--- {args.model} {dtype} {title} llama_server", flush=True)
                try:
                    results["llama_server"] = llama_server_run(args.llama_server, Path(gguf_dir) / gguf_name[dtype],
                                                               prompt_ids(workload, model), max_tokens, args.repeat)
                except (OSError, RuntimeError) as exc:
                    results["llama_server"] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
                print(json.dumps(results["llama_server"]), flush=True)
            else:
                results["llama_server"] = {"skipped": "no --llama-server and --gguf-dir given"}
            rows.append({"model": args.model, "dtype": dtype, "workload": title, "results": results})
    md = report(rows, args.repeat)
    write_report(args.out, md, rows)


if __name__ == "__main__":
    main()
