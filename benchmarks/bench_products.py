"""Kev's Linear products alone at one decoder layer's shapes: from memory and from cache, in GFLOP/s.

Why a separate script: a decode step's time is its products' plus everything around them, and on a
shared VM whole steps drift between runs; this times only `linear_packed` on a layer's four
weights (q/k/v, o, gate/up, down) so a kernel change is seen by itself. "From memory" cycles over
enough copies of each weight (about 1.2 GB) that none is in cache when it is read again, as in a
decode step; "hot" reads one copy again and again (in cache where it fits: gate/up at 0.7B does
not fit a 32 MB L3). Compare the GFLOP/s with the core's peak (`dp_peak.c`) and the GB/s with
the machine's read bandwidth (`bench_decode_roofline.py` measures it).

Shapes: a `random_models` Llama ("llama-0.5b", "llama-0.7b": their configs) or "embedded"
(SmolLM2-135M: hidden 576, MLP 1536, 9 and 3 heads of 64).

Usage: python benchmarks/bench_products.py [--model llama-0.7b] [--rows 16 1] [--dtype bfloat16]
       [--path avx512_bf16|fma|amx]   (a bf16 path other than this machine's, for comparison)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import random_models  # noqa: E402
from machine import cpu_line  # noqa: E402

from kev_engine.platforms.cpu.kernels import load_kernels  # noqa: E402

EMBEDDED = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
            "head_dim": 64}  # SmolLM2-135M-Instruct's config
MODELS = {"embedded": EMBEDDED, "llama-0.5b": random_models.SHAPES["llama-0.5b"],
          "llama-0.7b": random_models.SHAPES["llama-0.7b"]}
COLD_BYTES = 1.2e9  # the copies cycled over: several times any L3


def products(config: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(outputs, inputs) of a layer's products, q/k/v and gate/up fused as the engine's layer fuses them."""
    hidden, mlp, dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    return {"qkv": ((heads + 2 * kv_heads) * dim, hidden), "o": (hidden, heads * dim), "gate_up": (2 * mlp, hidden),
            "down": (hidden, mlp)}


def best_of(repeat: int, kernels: Any, x: torch.Tensor, weights: list[torch.Tensor], n: int, path: str) -> float:
    """The best of `repeat` runs' seconds per product, each run one product with every weight in turn."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for w in weights:
            kernels.linear_packed(x, w, n, None, path)
        best = min(best, (time.perf_counter() - started) / len(weights))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-0.7b", choices=list(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--path", default="", help="a bf16 path by name; default: the one an engine here uses")
    args = ap.parse_args()
    kernels = load_kernels()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"# {cpu_line()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}, "
          f"{args.dtype}, kernels {kernels.linear_paths}{', path ' + args.path if args.path else ''}")
    for rows in args.rows:
        total_cold = total_hot = 0.0
        for name, (n, k) in products(MODELS[args.model]).items():
            size = n * k * dtype.itemsize
            weights = [kernels.linear_pack(torch.randn(n, k).to(dtype)) for _ in range(max(2, int(COLD_BYTES // size)))]
            x = torch.randn(rows, k).to(dtype)
            best_of(1, kernels, x, weights[:2], n, args.path)  # warm-up
            cold = best_of(3, kernels, x, weights, n, args.path)
            hot = best_of(20, kernels, x, weights[:1], n, args.path)
            flops = 2 * rows * n * k
            total_cold, total_hot = total_cold + cold, total_hot + hot
            print(f"rows {rows:3d} {name:8s} from memory {cold * 1e3:7.3f} ms {size / cold / 1e9:5.1f} GB/s "
                  f"{flops / cold / 1e9:6.1f} GFLOP/s | hot {hot * 1e3:7.3f} ms {flops / hot / 1e9:6.1f} GFLOP/s",
                  flush=True)
            del weights
        print(f"rows {rows:3d} layer    from memory {total_cold * 1e3:7.3f} ms | hot {total_hot * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
