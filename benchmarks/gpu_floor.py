"""The floor under a GPU workload: what the device's measured bandwidth and arithmetic allow.

`bench_gpu.py` puts each measured time beside its floor, both from the same run:
  rates     the device's read bandwidth (a sum over 2 GiB, best of five) and its bf16 matrix
            rate (torch's 8192³ product, best of five): measured, never a data-sheet figure;
  floor     a workload answered greedily, `max_tokens` each, as the fewest passes can: one
            prefill of every prompt token (the products' flops, attention's over each prompt's
            triangle, and the weights read once), then `max_tokens - 1` decode steps of every
            question at once, each reading the weights and every question's keys/values so far.
            A pass takes the longer of its bytes over the bandwidth and its flops over the rate;
            the floor is their sum. Shared prefixes are counted in full (Kev computes them once,
            so it may beat this part of the floor) and nothing is charged for sampling or launches.
`products` times the model's own weight shapes through Kev's fixed-order Triton product and
torch's at a prefill's row count, against the measured rate, and at a decode step's 16 rows:
each shape's `Tiles`, its chunks spread over programs of their own (as the engine runs 16 rows)
beside one program a tile, against the weight's bytes over the measured bandwidth.
The figures are a GPU's (`make gpu-check`); on a CPU the same code runs in tests, small, for its
plumbing, never as a figure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

READ_BYTES = 2 << 30
MATMUL_SIZE = 8192
REPEATS = 5


@dataclass(frozen=True)
class Shape:
    """What the floor needs of a decoder: its sizes and the bytes of its weights as they sit on the device."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    weight_bytes: int
    dtype_bytes: int = 2

    @classmethod
    def of(cls, model: Any) -> Shape:
        """From Kev's model (`models.llama.DecoderModel`)."""
        return cls(len(model.layers), model.hidden, model.num_heads, model.num_kv_heads, model.head_dim,
                   model.intermediate, int(model.config.vocab_size), model.weight_bytes(),
                   torch.tensor([], dtype=model.dtype).element_size())

    @property
    def product_flops_per_token(self) -> int:
        """2 × the multiply-adds of one token through every layer's products (the head apart)."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        attention = qkv + self.heads * self.head_dim * self.hidden  # and the output projection
        return 2 * self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def attention_flops(self, pairs: int) -> int:
        """Scores and weighted values over `pairs` (query, key) pairs, every layer and head."""
        return 4 * self.layers * self.heads * self.head_dim * pairs


def floor(shape: Shape, prompt_lengths: list[int], max_tokens: int, read_bytes_s: float,
          flop_s: float) -> dict[str, float]:
    """Seconds the fewest passes need (see the module's docstring): prefill, decode and their sum."""
    questions, tokens = len(prompt_lengths), sum(prompt_lengths)
    head = 2 * shape.hidden * shape.vocab
    flops = shape.product_flops_per_token * tokens + head * questions
    flops += shape.attention_flops(sum(n * (n + 1) // 2 for n in prompt_lengths))
    prefill = max(shape.weight_bytes / read_bytes_s, flops / flop_s)
    decode = 0.0
    for step in range(1, max_tokens):
        context = tokens + questions * step  # every question's keys so far, its new one included
        step_bytes = shape.weight_bytes + shape.kv_bytes_per_token * context
        step_flops = (shape.product_flops_per_token + head) * questions + shape.attention_flops(context)
        decode += max(step_bytes / read_bytes_s, step_flops / flop_s)
    return {"prefill_s": prefill, "decode_s": decode, "floor_s": prefill + decode}


def best_of(device: torch.device, run: Callable[..., Any], *args: Any, repeats: int = REPEATS) -> float:
    """The fastest of `repeats` timed runs of `run(*args)`, in seconds, after one untimed."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run(*args)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run(*args)
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def rates(device: torch.device, read_bytes: int = READ_BYTES, size: int = MATMUL_SIZE) -> dict[str, float]:
    """The device's read bandwidth (bytes/s) and bf16 matrix rate (flop/s), measured now."""
    read = read_bytes / best_of(device, torch.sum, torch.ones(read_bytes // 2, dtype=torch.bfloat16, device=device))
    square = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    flops = 2 * size**3 / best_of(device, torch.mm, square, square)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"read_bytes_s": read, "bf16_flop_s": flops}


def products(model: Any, device: torch.device, rows: int, flop_s: float, read_bytes_s: float | None = None,
             decode_rows: int = 16) -> list[dict[str, Any]]:
    """Each distinct weight shape of Kev's model through the fixed-order Triton product and torch's,
    `rows` rows: TFLOP/s and the fraction of the measured rate; then `decode_rows` rows in
    microseconds, the chunks spread and not, beside the weight's read at `read_bytes_s`."""
    from kev_engine.platforms.cuda import triton_kernels

    shapes: dict[tuple[int, int], list[str]] = {}
    for name in ("qkv", "o", "gate_up", "down"):
        part = getattr(model.layers[0], name)
        shapes.setdefault((part.out_features, part.in_features), []).append(name)
    shapes.setdefault((model.head.out_features, model.head.in_features), []).append("head")
    out = []
    for (n, k), names in shapes.items():
        weight = torch.randn(n, k, dtype=model.dtype, device=device)
        x = torch.randn(rows, k, dtype=model.dtype, device=device)
        work = 2 * rows * n * k
        triton_s = best_of(device, triton_kernels.linear, x, weight, None)
        torch_s = best_of(device, torch.nn.functional.linear, x, weight)
        tiles = triton_kernels.tiles_for(n, k, model.dtype)
        few = x[:decode_rows]
        spread_s = best_of(device, triton_kernels.linear, few, weight, None, tiles, True)
        tiled_s = best_of(device, triton_kernels.linear, few, weight, None, tiles, False)
        out.append({"weights": names, "n": n, "k": k, "rows": rows, "triton_tflop_s": work / triton_s / 1e12,
                    "torch_tflop_s": work / torch_s / 1e12, "triton_of_measured_peak": work / triton_s / flop_s,
                    "tiles": f"{tiles.bm}x{tiles.bn}x{tiles.bk} w{tiles.warps} s{tiles.stages}",
                    "chunks": tiles.splits(k), "decode_rows": decode_rows, "decode_spread_us": spread_s * 1e6,
                    "decode_one_program_a_tile_us": tiled_s * 1e6,
                    "decode_torch_us": best_of(device, torch.nn.functional.linear, few, weight) * 1e6,
                    "weight_read_us": weight.nbytes / read_bytes_s * 1e6 if read_bytes_s else None})
    return out
