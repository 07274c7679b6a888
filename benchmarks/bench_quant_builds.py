"""This tree's quantized products against an earlier checkout's, both in ONE process, alternating.

Why one process: on a VM whose memory bandwidth drifts by half between minutes, two processes run
one after the other compare the drift, not the kernels. Here both builds are loaded side by side
(each checkout's compiled kernels, each with its own checkout's `models/quant.py` layout), and
every measurement alternates between them, so both see the same minute. Each side computes on its
own layout of the same random weight, and the answers are compared bit for bit (a layout change
must keep every bit): one row and 64 rows, per dtype.

Per format and dtype: a one-row product streamed from memory (700 MB of copies of the weight, each
used once) and from cache (the same weight again), best of 3 rounds x 3 (streamed) or x 40 (cached).

Usage: python benchmarks/bench_quant_builds.py --baseline DIR [--type Q4_K Q6_K ...]
(make DIR with `git worktree add DIR COMMIT`; its kernels are built there the first time.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_quant_products as products  # noqa: E402
from bench_decode_roofline import best_seconds  # noqa: E402
from machine import cpu_line  # noqa: E402

from kev_engine.models import quant  # noqa: E402
from kev_engine.platforms.cpu import kernels  # noqa: E402

PATHS = {"bfloat16": "avx512_bf16", "float32": ""}


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def baseline_build(tree: Path) -> Path:
    """The compiled exact kernels of the checkout at `tree` (built there if they are not yet)."""
    code = "from kev_engine.platforms.cpu import kernels; print(kernels.load_kernels()._builds[0].__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of an earlier commit")
    parser.add_argument("--type", nargs="+", default=["Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q8_0"],
                        choices=sorted(products.TYPES))
    args = parser.parse_args()
    tree = args.baseline.resolve()
    built = baseline_build(tree)
    old_kernels = load_module(built, built.stem)
    old_layout = load_module(tree / "kev_engine" / "models" / "quant.py", "baseline_quant")
    new_kernels = kernels.load_kernels()._builds[0]
    print(f"# bench_quant_builds ({time.strftime('%Y-%m-%d')}, {cpu_line()}, torch {torch.__version__}; this tree "
          f"{new_kernels.__name__} against {tree.name} {old_kernels.__name__})\n")
    print("| type | dtype | same bits | one row streamed ms this / baseline | cached ms this / baseline |")
    print("|---|---|---|---|---|")
    for name in args.type:
        weight = products.random_weight(name, np.random.default_rng(0))
        sides = {"this": (new_kernels, quant.tile(weight)), "baseline": (old_kernels, old_layout.tile(weight))}
        for dtype, path in PATHS.items():
            same, streamed, cached = measure(sides, products.TYPES[name], getattr(torch, dtype), path)
            print(f"| {name} | {dtype} | {'yes' if same else 'NO'} | {streamed['this'] * 1e3:.3f} / "
                  f"{streamed['baseline'] * 1e3:.3f} | {cached['this'] * 1e3:.3f} / {cached['baseline'] * 1e3:.3f} |",
                  flush=True)


def measure(sides: dict[str, tuple[ModuleType, torch.Tensor]], kind: int, dtype: torch.dtype,
            path: str) -> tuple[bool, dict[str, float], dict[str, float]]:
    """Whether both sides give the same bits, and each side's best one-row seconds streamed and cached."""

    def product(side: str, x: torch.Tensor, tiled: torch.Tensor) -> torch.Tensor:
        return sides[side][0].quant_linear(x, [tiled], [kind], [products.N], None, path)

    def inputs(rows: int) -> torch.Tensor:
        return torch.randn(rows, products.K, generator=torch.Generator().manual_seed(rows)).to(dtype)

    same = all(torch.equal(product("this", inputs(rows), sides["this"][1]),
                           product("baseline", inputs(rows), sides["baseline"][1])) for rows in (1, 64))
    x = inputs(1)
    copies = {side: [t.clone() for _ in range(int(products.STREAM_BYTES // t.numel()))]
              for side, (_, t) in sides.items()}
    streamed = {side: float("inf") for side in sides}
    cached = dict(streamed)
    for _ in range(3):
        for side, (_, one) in sides.items():
            sweep = partial(lambda side, weights: [product(side, x, t) for t in weights], side, copies[side])
            every = best_seconds(sweep, 3)
            streamed[side] = min(streamed[side], every / len(copies[side]))
            cached[side] = min(cached[side], best_seconds(partial(product, side, x, one), 40))
    return same, streamed, cached

if __name__ == "__main__":
    main()
