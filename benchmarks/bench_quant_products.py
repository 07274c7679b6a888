"""One quantized product at a time: a GGUF format's one-row and prefill products against memory and dense.

For each GGML type asked for, random blocks of one weight of the 0.7B Llama's fused gate/up shape
(11,264 outputs x 2,048 inputs; K-quant scales set so the weights lie within about +-0.03, as
`bench_quant.write_random_k_quants` writes them) are tiled as Kev keeps them, and timed in Kev's
`quant_linear` (the block-scaled products of csrc/quant_scaled.cpp, a generated token's rows'; bf16
on the path named by --path, default fma, which never decodes on AMX):
  - one row, streamed: enough copies of the weight to fill ~700 MB (past any L3) swept in turn, so
    each product reads its weight from memory as a decode step does: ms a weight, GB/s of its
    blocks, and that beside the read bandwidth measured in the same run (torch's matrix-vector
    product over 1 GiB);
  - one row, cached: the same weight again and again (from the L3), the products' own arithmetic;
  - --rows rows, block-scaled and as a prompt's rows (`prompt`: the weight decoded, csrc/quant.cpp,
    where the build has AVX-512), against `linear_packed` on the same weight dequantized (dense bf16
    on the same path, or fp32), in GFLOP/s.
Best of 5 sweeps (50 for the cached row). The figures are the kernels' alone: a whole decode step
and whole engines are bench_quant.py's.

Usage: python benchmarks/bench_quant_products.py [--type Q4_K Q6_K Q8_0 Q4_1 (also Q4_0 Q5_0 Q5_1 Q5_K)]
           [--rows 132 300] [--dtype bfloat16 float32] [--path fma|avx512_bf16] [--out PATH]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_roofline import best_seconds, read_bandwidth  # noqa: E402
from bench_invariance import write_report  # noqa: E402
from machine import cpu_line  # noqa: E402

RESULTS_MD = Path(__file__).resolve().parent / "results" / "bench_quant_products.md"
N, K = 11264, 2048
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
STREAM_BYTES = 700e6


def random_weight(name: str, rng: np.random.Generator) -> Any:
    """A QuantTensor [N, K] of random blocks whose scales keep its weights small (as a model's)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from kev_engine.models.quant import QuantTensor

    kind = GGMLQuantizationType(TYPES[name])
    block_k, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(N, K // block_k, block_bytes), dtype=np.uint8)
    half = np.float16
    if name == "Q6_K":  # 16 int8 scales of 16, then d
        blocks[..., 192:208] = 16
        blocks[..., 208:210] = np.array([1e-4], dtype=half).view(np.uint8)
    elif name in ("Q4_K", "Q5_K"):  # d, dmin, every group's six-bit scale and min 32
        blocks[..., 0:2] = np.array([1e-4], dtype=half).view(np.uint8)
        blocks[..., 2:4] = np.array([7.5e-4], dtype=half).view(np.uint8)
        blocks[..., 4:12] = 160
        blocks[..., 12:16] = 0
    else:  # d first; Q4_1's and Q5_1's m after it
        blocks[..., 0:2] = np.array([1e-3], dtype=half).view(np.uint8)
        if name in ("Q4_1", "Q5_1"):
            blocks[..., 2:4] = np.array([-8e-3], dtype=half).view(np.uint8)
    return QuantTensor(TYPES[name], N, K, blocks.reshape(N, -1))


def measure(name: str, dtype: Any, rows: list[int], path: str, rng: np.random.Generator) -> dict[str, Any]:
    import torch

    from kev_engine.models.quant import tile
    from kev_engine.platforms.cpu import kernels

    built = kernels.load_kernels()
    weight = random_weight(name, rng)
    one = tile(weight)
    copies = [one.clone() for _ in range(max(2, int(STREAM_BYTES // one.numel())))]
    path_arg = path if dtype == torch.bfloat16 else ""
    x = torch.randn(1, K).to(dtype)

    def sweep(weights: list[Any]) -> None:
        for t in weights:
            built.quant_linear(x, [t], [TYPES[name]], [N], None, path_arg)

    streamed = best_seconds(lambda: sweep(copies), 5) / len(copies)
    copies.clear()
    cached = best_seconds(lambda: built.quant_linear(x, [one], [TYPES[name]], [N], None, path_arg), 50)
    row: dict[str, Any] = {"type": name, "dtype": str(dtype).removeprefix("torch."), "bytes": int(one.numel()),
                           "streamed_s": streamed, "cached_s": cached, "prefill": {}}
    dense = built.linear_pack(weight.dequantized().to(dtype))
    for m in rows:
        xs = torch.randn(m, K).to(dtype)
        every = torch.ones(m, dtype=torch.bool)
        quant = best_seconds(lambda xs=xs: built.quant_linear(xs, [one], [TYPES[name]], [N], None, path_arg), 5)
        prompt = best_seconds(lambda xs=xs, every=every: built.quant_linear(xs, [one], [TYPES[name]], [N], None,
                                                                            path_arg, prompt=every), 5)
        packed = best_seconds(lambda xs=xs: built.linear_packed(xs, dense, N, None, path_arg), 5)
        row["prefill"][m] = {"quant_s": quant, "prompt_s": prompt, "dense_s": packed}
    print(f"  {name} {row['dtype']}: one row {streamed * 1e3:.3f} ms streamed, {cached * 1e3:.3f} ms cached",
          flush=True)
    return row


def report(rows: list[dict[str, Any]], bandwidth: float, how: str, path: str) -> str:
    import torch

    lines = [f"# bench_quant_products: one product on a GGUF's blocks ({cpu_line()}; torch {torch.__version__}, "
             f"{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
             f"One {N} x {K} weight of random blocks; block-scaled products, and rows marked a prompt's "
             f"(bf16 on the {path} path). Read "
             f"bandwidth measured in this run: {bandwidth / 1e9:.1f} GB/s ({how}). Best of 5 (cached row: of 50).",
             "", "| type | dtype | MB | one row streamed ms | GB/s | / roofline | one row cached ms | "
             + " | ".join(f"{m} rows ms block-scaled / prompt / dense (GFLOP/s)" for m in rows[0]["prefill"]) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(rows[0]["prefill"])]
    for row in rows:
        roofline = row["bytes"] / bandwidth
        cells = [" / ".join(f"{p[key] * 1e3:.2f}" for key in ("quant_s", "prompt_s", "dense_s")) + " ("
                 + " / ".join(f"{2 * m * N * K / p[key] / 1e9:.0f}" for key in ("quant_s", "prompt_s", "dense_s"))
                 + ")" for m, p in row["prefill"].items()]
        lines.append(f"| {row['type']} | {row['dtype']} | {row['bytes'] / 1e6:.1f} | {row['streamed_s'] * 1e3:.3f} | "
                     f"{row['bytes'] / row['streamed_s'] / 1e9:.1f} | {row['streamed_s'] / roofline:.2f}x | "
                     f"{row['cached_s'] * 1e3:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--type", nargs="+", default=["Q4_K", "Q6_K", "Q8_0", "Q4_1"], choices=list(TYPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[132, 300])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    ap.add_argument("--path", default="fma", choices=["fma", "avx512_bf16"], help="the bf16 products' path")
    ap.add_argument("--out", default=str(RESULTS_MD), help="the report's path (.md; its .json beside it)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = [measure(name, getattr(torch, dtype), args.rows, args.path, rng)
            for name in args.type for dtype in args.dtype]
    bandwidth, how = read_bandwidth()
    write_report(args.out, report(rows, bandwidth, how, args.path), rows)


if __name__ == "__main__":
    main()
