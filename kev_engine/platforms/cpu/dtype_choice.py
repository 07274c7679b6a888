"""`dtype="auto"` on a CPU: bfloat16 only where it is measured faster than float32 here.

Why: an instruction set says what a CPU can do, not how fast Kev's kernels do it there. On a CPU
with AMX, Kev's bf16 products run at about twice fp32's speed; on one with AVX512-BF16 but no AMX
(AMD Zen 4/5) the same kernels can be slower than fp32 — and without either, bf16 is emulated.
So where the CPU multiplies bf16 natively, the first `dtype="auto"` times the products the
default (batch-invariant) engine runs — Kev's packed Linear product, a prefill-sized and a
decode-sized call — in both dtypes and picks the faster; the decision is cached beside the
kernels (`KEV_CACHE_DIR`), keyed by the kernels' build (CPU, `KEV_CPU_ISA`, torch, sources), so
each machine and environment measures once. Without native bf16 it is float32, unmeasured. An
explicit dtype is always honoured.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from . import isa, kernels

log = logging.getLogger("kev")

CACHE_FILE = "dtype-choice.json"
SHAPES = ((512, 1024, 2048), (16, 1024, 2048))  # (rows, in, out): a prefill chunk and a decode step
REPEATS = 3  # each shape's best of this many calls, after a warm-up


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "float32" or "bfloat16"
    reason: str
    float32_ms: float | None = None
    bfloat16_ms: float | None = None


def choose(measure: Callable[[torch.dtype], float] | None = None) -> DtypeChoice:
    """The dtype `dtype="auto"` loads a model in on this CPU, and why (see the module docstring).
    `measure(dtype)`: milliseconds of this CPU's products in that dtype (the kernels' by default)."""
    if not isa.native_bf16():
        return DtypeChoice("float32", "this CPU has neither AMX nor AVX512-BF16: bfloat16 would be emulated")
    key = _key()
    cached = _read_cache().get(key)
    if cached is not None:
        return DtypeChoice(**cached)
    try:
        timer = measure or _kernel_products
        fp32, bf16 = timer(torch.float32), timer(torch.bfloat16)
    except RuntimeError as exc:  # the kernels cannot be built: the engine runs torch's ops, untimed here
        return DtypeChoice("bfloat16", f"this CPU multiplies bfloat16 natively ({exc}; not measured)")
    faster = "bfloat16" if bf16 < fp32 else "float32"
    choice = DtypeChoice(faster, f"Kev's bfloat16 products took {bf16:.1f} ms against float32's {fp32:.1f} ms "
                                 f"on this CPU ({isa.resolve()} instruction set), measured once", fp32, bf16)
    _write_cache(key, choice)
    log.info("Kev: dtype='auto' is %s here: %s (cached in %s)", faster, choice.reason, _cache_path())
    return choice


def _key() -> str:
    """The kernels' build names: new sources, flags, `KEV_CPU_ISA`, torch, CPU or toolchain measure again."""
    return kernels.build_name("exact")


def _cache_path() -> Path:
    return kernels.build_root() / CACHE_FILE


def _read_cache() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, choice: DtypeChoice) -> None:
    data = _read_cache()
    data[key] = asdict(choice)
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        temporary.write_text(json.dumps(data, indent=1))
        temporary.replace(path)  # whole or not at all, if two processes measure at once
    except OSError as exc:
        log.info("Kev: could not cache the dtype choice in %s (%s); it is measured again next time", path, exc)


def _kernel_products(dtype: torch.dtype) -> float:
    """Milliseconds of Kev's packed Linear product over `SHAPES` in `dtype` (each shape's best call)."""
    loaded = kernels.load_kernels()
    total = 0.0
    generator = torch.Generator().manual_seed(0)
    for rows, inputs, outputs in SHAPES:
        x = torch.randn(rows, inputs, generator=generator).to(dtype)
        packed = loaded.linear_pack(torch.randn(outputs, inputs, generator=generator).to(dtype))
        loaded.linear_packed(x, packed, outputs)  # warm-up: pages, caches
        best = float("inf")
        for _ in range(REPEATS):
            started = time.perf_counter()
            loaded.linear_packed(x, packed, outputs)
            best = min(best, time.perf_counter() - started)
        total += best * 1000
    return total
