"""A decode step against the bandwidth roofline, the machine's bandwidth measured in the same run.

Why: a decode step computes little per weight (one multiply-add per weight and row), so every
step streams all the Linear weights from memory once, and its time is bounded below by
`weight bytes / read bandwidth`. Its attention also reads every row's cached keys and values once
(each row its own: 16 rows of 300 positions read 16 x 300 positions' worth), so the step's full
bound is `(weight bytes + KV bytes) / read bandwidth`; both are reported, the weights-only one
and the one with the cache. How far a step is above the bound says what is left to gain: at the
bound the step is memory-bound and only fewer bytes (a smaller dtype) help; far above it, the
products' or attention's code or everything around them (Python, small operations) is what costs.

Measured here, in one process:
  bandwidth  the best of torch's `sum` and its matrix-vector product (MKL's GEMV on x86) over
             1 GiB of float32, on the engine's threads: the read bandwidth code can reach (after
             the engines: touching 1 GiB first slowed the steps measured after it);
  steps      an engine (batch-invariant unless --fast, no pass budget: the prompts in one pass)
             answers `rows` questions (the RAG-16 chats, reused in turn, each run its own cache
             salt; a first run of the same batch warms up), and every pass in which all of them
             decode one token is timed: the model's forward alone, and the whole step (scheduling,
             packing, sampling too); medians over the passes;
  KV bytes   per timed step, the positions its rows attend (each row's past and its new token)
             x layers x key and value heads x head size x 2 (keys, values) x the cache's element
             size: what the step's attention reads at least once; the median over the steps.

Models: "embedded" (SmolLM2-135M-Instruct, its own weights), "llama-0.5b" and "llama-0.7b" (0.48B
and 0.73B parameters, random weights on the embedded model's tokenizer, `random_models`): random
weights do not change a kernel's speed.

Usage: python benchmarks/bench_decode_roofline.py [--model embedded llama-0.5b llama-0.7b] [--dtype float32 bfloat16]
       [--rows 1 16] [--steps 24] [--fast] [--out PATH]
       As a CPU without AMX runs it: python -m kev_engine.platforms.cpu.isa no-amx -- python benchmarks/...
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import random_models  # noqa: E402
from machine import cpu_line  # noqa: E402
from workload import load_rag, rag_messages  # noqa: E402

from kev_engine import (  # noqa: E402
    Engine,
    SamplingParams,
    loader,  # noqa: E402
)

RESULTS = Path(__file__).resolve().parent / "results" / "bench_decode_roofline.md"
GIB = 1 << 30


def best_seconds(run: Any, repeat: int) -> float:
    """The least wall seconds of `repeat` calls of `run`, after one untimed call."""
    run()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def read_bandwidth(repeat: int = 5) -> tuple[float, str]:
    """Bytes per second the best of two streaming reads of 1 GiB reach, and which one."""
    data = torch.ones(GIB // 4)
    matrix, vector = data.view(-1, 4096), torch.ones(4096)
    best: dict[str, float] = {}
    for name, read in (("sum", lambda: data.sum()), ("matrix-vector", lambda: torch.mv(matrix, vector))):
        best[name] = GIB / best_seconds(read, repeat)
    name = max(best, key=lambda k: best[k])
    return best[name], ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in best.items())


def weight_bytes(model: Any) -> int:
    """What one decode step streams: every Linear weight (the output head's included) once."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel() * module.weight.element_size()
    return total


def kv_bytes_per_position(config: Any, dtype: torch.dtype) -> int:
    """The cached keys and values of one position, all layers: what attention reads per position."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * kv_heads * head_dim * 2 * torch.empty(0, dtype=dtype).element_size()


def model_folder(name: str, dtype: torch.dtype, scratch: Path) -> str:
    embedded = loader.converted_gguf_dir(loader.embedded_gguf())
    if name == "embedded":
        return str(embedded)
    out = scratch / f"{name}-{str(dtype).split('.')[-1]}"
    if not (out / "config.json").exists():
        random_models.build(Path(embedded), name, out, device="cpu", dtype=dtype)
    return str(out)


def decode_steps(folder: str, dtype: torch.dtype, rows: int, steps: int, invariant: bool) -> dict[str, Any]:
    """Median forward and whole-step seconds of the passes in which all `rows` questions decode."""
    # no pass budget: the batch's prompts in one pass, so that every question decodes in the same steps
    engine = Engine.from_pretrained(folder, dtype=dtype, batch_invariant=invariant, pass_time_ms=math.inf)
    runner, stepper = engine._runner, engine._stepper
    forwards: list[tuple[int, float]] = []
    whole: list[tuple[int, float]] = []
    attended: list[tuple[int, int]] = []  # (tokens, positions its rows attend) per pass
    forward, step = runner.forward, stepper.step

    def timed_forward(batch: Any, adapters: Any) -> torch.Tensor:
        started = time.perf_counter()
        out = forward(batch, adapters)
        forwards.append((batch.num_tokens, time.perf_counter() - started))
        ends = batch.cu_seqlens_list
        attended.append((batch.num_tokens, sum(past + ends[i + 1] - ends[i] for i, past in enumerate(batch.past_lens))))
        return out

    def timed_step() -> int:
        started = time.perf_counter()
        tokens = step()
        if tokens:
            whole.append((tokens, time.perf_counter() - started))
        return tokens

    runner.forward, stepper.step = timed_forward, timed_step  # type: ignore[method-assign]
    chats = [rag_messages(q) for q in load_rag()]
    batch = [chats[i % len(chats)] for i in range(rows)]
    sampling = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, cache_salt="timed")
    try:
        engine.generate(batch, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, cache_salt="warm-up"))
        forwards.clear()
        whole.clear()
        attended.clear()
        engine.generate(batch, sampling)
        weights = weight_bytes(engine.model)
        per_position = kv_bytes_per_position(engine.model.config, engine.dtype)
    finally:
        engine.close()
    decode_forwards = [s for n, s in forwards if n == rows]
    decode_steps_ = [s for n, s in whole if n == rows]
    if not decode_forwards:
        raise SystemExit(f"no pass had all {rows} questions decoding (passes of {[n for n, _ in forwards]} tokens); "
                         "raise --steps")
    positions = [p for n, p in attended if n == rows]
    return {"forward_s": statistics.median(decode_forwards), "step_s": statistics.median(decode_steps_),
            "passes": len(decode_forwards), "weight_bytes": weights,
            "kv_bytes": statistics.median(positions) * per_position}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models = ["embedded", "llama-0.5b", "llama-0.7b"]
    ap.add_argument("--model", nargs="+", default=models, choices=models)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--steps", type=int, default=24, help="new tokens per question (passes timed: about this many)")
    ap.add_argument("--fast", action="store_true", help="batch_invariant=False (torch's and Kev's fast kernels)")
    ap.add_argument("--out", default=str(RESULTS), help="the report's path")
    args = ap.parse_args()
    if any(r < 1 for r in args.rows):
        raise SystemExit(f"--rows {args.rows}: every value must be at least 1")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rows: list[tuple[str, str, int, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="kev-roofline-") as scratch:
        for name in args.model:
            for dtype_name in args.dtype:
                dtype = getattr(torch, dtype_name)
                folder = model_folder(name, dtype, Path(scratch))
                for count in args.rows:
                    print(f"bench_decode_roofline: {name} {dtype_name} {count} rows ...", file=sys.stderr)
                    timed = decode_steps(folder, dtype, count, args.steps, not args.fast)
                    rows.append((name, dtype_name, count, timed))
    bandwidth, how = read_bandwidth()  # after the engines: 1 GiB touched before them slowed their steps
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({how})", file=sys.stderr)
    from kev_engine.platforms.cpu import isa, kernels

    lines = [f"# bench_decode_roofline ({time.strftime('%Y-%m-%d')}, {cpu_line()}, torch {torch.__version__}, "
             f"{'batch_invariant=False' if args.fast else 'batch-invariant'}, KEV_CPU_ISA={isa.resolve()}, "
             f"kernels {kernels.load_kernels().linear_paths})", "",
             f"Read bandwidth {bandwidth / 1e9:.1f} GB/s (best of {how}, 1 GiB float32). Roofline: the "
             "step's Linear weights (output head included) read once at that bandwidth; with KV: the "
             "rows' cached keys and values read once too.", "",
             "| model | dtype | rows | weights MB | KV MB | roofline ms | with KV ms | forward ms | step ms | "
             "step / roofline | step / roofline with KV | passes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, dtype_name, count, r in rows:
        roofline = r["weight_bytes"] / bandwidth
        with_kv = (r["weight_bytes"] + r["kv_bytes"]) / bandwidth
        lines.append(f"| {name} | {dtype_name} | {count} | {r['weight_bytes'] / 1e6:.0f} | {r['kv_bytes'] / 1e6:.0f} | "
                     f"{roofline * 1e3:.1f} | {with_kv * 1e3:.1f} | {r['forward_s'] * 1e3:.1f} | "
                     f"{r['step_s'] * 1e3:.1f} | {r['step_s'] / roofline:.2f} | {r['step_s'] / with_kv:.2f} | "
                     f"{r['passes']} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
