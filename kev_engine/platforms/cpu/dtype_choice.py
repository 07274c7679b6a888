"""`dtype="auto"` on a CPU: bfloat16 only where it is measured faster than float32 here; and which
instructions Kev's bfloat16 products run on where the CPU offers a choice.

Why: an instruction set says what a CPU can do, not how fast Kev's kernels do it there. On a CPU
with AMX, Kev's bf16 products run at about twice fp32's speed; on one with AVX512-BF16 but no AMX
(AMD Zen 4/5, Intel Cooper Lake, a VM that hides AMX) the same kernels can be slower than fp32 —
and without either, bf16 is emulated. So where the CPU multiplies bf16 natively, the first
`dtype="auto"` times what the default (batch-invariant) engine runs, Kev's packed Linear products
and its attention, in both dtypes and picks the faster; the decision is cached beside the kernels
(`KEV_CACHE_DIR`), keyed by the kernels' build (CPU, `KEV_CPU_ISA`, torch, sources), so each machine
and environment measures once. Without native bf16 it is float32, unmeasured. An explicit dtype is
always honoured.

What is timed is a decode step of a model the default one's size with its share of prefill, as the
RAG batch Kev is built for runs them: the step's products through `STREAM` distinct weights and its
attention over `LAYERS` layers' KV cache for 16 rows of RAG-sized contexts, plus
`PROMPT_ROWS_PER_STEP` prompt rows' share of a prefill chunk's products through the same weights
(compute-bound: a chunk's weights stay in cache across its rows). The step's weights and KV come
from memory, not cache, as a real model's do: that is where bf16's halved bytes count, and a probe
that read them from cache would miss it (and pick fp32 where bf16 runs the batch faster).

The bf16 path (`choose_bf16_path`, when the kernels load): with AMX, AMX. With AVX512-BF16 but no
AMX, two paths compute bf16 products, each batch-invariant: `vdpbf16ps` (two products a lane per
instruction) and the fma path (bf16 pairs widened to fp32 and fused-multiply-added). Where
`vdpbf16ps` retires at a fused multiply-add's rate (Zen 4/5) it does twice the work; where it
retires at half that or less (Intel cores without AMX), the fma path is faster. So the two are
timed on the same calls, once per build, and the faster one serves every product of the process
(`linear.cpp`'s `set_bf16_path`: a process never mixes them). `KEV_BF16_PATH` (amx, avx512_bf16
or fma) names one instead, unmeasured.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from . import isa, kernels

log = logging.getLogger("kev")

CACHE_FILE = "dtype-choice.json"
PATH_ENV = "KEV_BF16_PATH"
BF16_PATHS = ("amx", "avx512_bf16", "fma")
IN, OUT = 1024, 2048  # each timed product's weight: in x out
STREAM = 64  # distinct weights a decode step reads: 128 M parameters (512 MB in fp32), the default model's
PREFILL_ROWS = 512  # a prefill chunk
CONTEXTS = tuple(range(132, 500, 23))  # the decode step's 16 rows: their past tokens, the RAG batch's sizes
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 32  # the default model's attention, Kev's KV blocks
PROMPT_ROWS_PER_STEP = 100  # the RAG batch's mix: 16 questions of ~300 prompt tokens, 48 new tokens
REPEATS = 3  # each timing the best of this many, after a warm-up
PROBE = 2  # what is timed, in the cache's keys: a decision cached by another probe is measured again


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "float32" or "bfloat16"
    reason: str
    float32_ms: float | None = None
    bfloat16_ms: float | None = None


@dataclass(frozen=True)
class PathChoice:
    path: str  # one of BF16_PATHS
    reason: str
    timings_ms: dict[str, float] | None = None  # each path measured: its milliseconds


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
        timer = measure or _kernel_step
        fp32, bf16 = timer(torch.float32), timer(torch.bfloat16)
    except RuntimeError as exc:  # the kernels cannot be built: the engine runs torch's ops, untimed here
        return DtypeChoice("bfloat16", f"this CPU multiplies bfloat16 natively ({exc}; not measured)")
    faster = "bfloat16" if bf16 < fp32 else "float32"
    choice = DtypeChoice(faster, f"Kev's bfloat16 products and attention took {bf16:.1f} ms against float32's "
                                 f"{fp32:.1f} ms (a decode step reading its weights and KV from memory, and its "
                                 f"prompt rows' prefill) on this CPU ({_where()}), measured once",
                         fp32, bf16)
    _write_cache(key, asdict(choice))
    log.info("Kev: dtype='auto' is %s here: %s (cached in %s)", faster, choice.reason, _cache_path())
    return choice


def _build_key() -> str:
    """The kernels' build name and the probe's: new sources, flags, `KEV_CPU_ISA`, torch, CPU,
    toolchain or a new probe measure again."""
    return f"{kernels.build_name('exact')} probe={PROBE}"


def _key() -> str:
    """The dtype choice's key: the build, and the bf16 path asked for, if any (the products run on it)."""
    asked = os.environ.get(PATH_ENV)
    return _build_key() + (f" {PATH_ENV}={asked}" if asked else "")


def _cache_path() -> Path:
    return kernels.build_root() / CACHE_FILE


def _read_cache() -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    data = _read_cache()
    data[key] = entry
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        temporary.write_text(json.dumps(data, indent=1))
        temporary.replace(path)  # whole or not at all, if two processes measure at once
    except OSError as exc:
        log.info("Kev: could not cache a choice in %s (%s); it is measured again next time", path, exc)


def choose_bf16_path(exact: Any) -> PathChoice:
    """The path Kev's bfloat16 products take in this process, set on the exact build `exact` before
    any product runs (kernels.load_kernels), and why (see the module docstring)."""
    native = _paths(exact)["bfloat16"]
    asked = os.environ.get(PATH_ENV)
    if asked:
        if asked not in BF16_PATHS:
            raise ValueError(f"{PATH_ENV}={asked!r} is not allowed; use one of {', '.join(BF16_PATHS)}")
        try:
            exact.set_bf16_path(asked)
        except RuntimeError as exc:
            raise ValueError(f"{PATH_ENV}={asked!r} cannot run here: {str(exc).splitlines()[0]}") from exc
        choice = PathChoice(asked, f"{PATH_ENV}={asked}")
    elif native != "avx512_bf16":
        choice = PathChoice(native, "AMX, this CPU's fastest" if native == "amx" else
                            "this CPU has neither AMX nor AVX512-BF16: products of bf16 pairs in fp32")
    else:
        key = f"{_build_key()} bf16_path"
        cached = _read_cache().get(key)
        if cached is not None:
            choice = PathChoice(**cached)
        else:
            timings = {path: _products(exact, torch.bfloat16, path) for path in ("avx512_bf16", "fma")}
            faster = min(timings, key=timings.__getitem__)
            measured = ", ".join(f"{path} {ms:.1f} ms" for path, ms in timings.items())
            choice = PathChoice(faster, f"the faster of the two on Kev's products here ({measured}), measured once",
                                {path: round(ms, 3) for path, ms in timings.items()})
            _write_cache(key, asdict(choice))
        exact.set_bf16_path(choice.path)
    log.info("Kev: bfloat16 products run on the %s path here: %s", choice.path, choice.reason)
    return choice


def _paths(exact: Any) -> dict[str, str]:
    """linear_paths()'s "float32:... bfloat16:..." as {dtype: path}."""
    return dict(part.split(":", 1) for part in exact.linear_paths().split())


def _where() -> str:
    """The instruction set, and the bf16 path where this process's kernels are loaded."""
    loaded = kernels.loaded()
    return isa.resolve() + " instruction set" + (f", the {loaded.bf16_path.path} path" if loaded else "")


def _kernel_step(dtype: torch.dtype) -> float:
    """Milliseconds of a decode step and its prompt rows' share of prefill in `dtype`, on Kev's
    kernels (see the module docstring)."""
    loaded = kernels.load_kernels()
    return _products(loaded, dtype) + _attention(loaded, dtype)


def _products(loaded: Any, dtype: torch.dtype, path: str = "") -> float:
    """Milliseconds of `loaded`'s packed products in `dtype` (bf16 on `path`, "" for the process's
    own) for one decode step of `len(CONTEXTS)` rows through `STREAM` weights read from memory, plus
    `PROMPT_ROWS_PER_STEP` rows' share of a `PREFILL_ROWS`-row chunk through the same weights."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT, IN, generator=generator).to(dtype)
    chunk = torch.randn(PREFILL_ROWS, IN, generator=generator).to(dtype)
    step = torch.randn(len(CONTEXTS), IN, generator=generator).to(dtype)
    packed = [loaded.linear_pack(weight) for _ in range(STREAM)]  # distinct copies: read from memory each step
    prefill_ms = _best(lambda: loaded.linear_packed(chunk, packed[0], OUT, None, path))
    step_ms = _best(lambda: [loaded.linear_packed(step, one, OUT, None, path) for one in packed])
    return step_ms + prefill_ms * STREAM * PROMPT_ROWS_PER_STEP / PREFILL_ROWS


def _attention(loaded: Any, dtype: torch.dtype) -> float:
    """Milliseconds of `loaded`'s attention in `dtype` for one decode step of `len(CONTEXTS)` rows
    over `LAYERS` layers' KV cache, each layer's blocks its own (read from memory, not cache)."""
    generator = torch.Generator().manual_seed(0)
    spans = [(past + 1 + BLOCK - 1) // BLOCK for past in CONTEXTS]  # the blocks of each row's past and itself
    blocks = sum(spans)
    keys = torch.randn(blocks, KV_HEADS, HEAD_DIM, BLOCK, generator=generator).to(dtype)
    values = torch.randn(blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=generator).to(dtype)
    pools = [(keys.clone(), values.clone()) for _ in range(LAYERS)]
    tables = torch.zeros(len(CONTEXTS), max(spans), dtype=torch.int32)
    first = 0
    for row, span in enumerate(spans):
        tables[row, :span] = torch.arange(first, first + span, dtype=torch.int32)
        first += span
    query = torch.randn(len(CONTEXTS), HEADS, HEAD_DIM, generator=generator).to(dtype)
    cu_seqlens = torch.arange(len(CONTEXTS) + 1, dtype=torch.int32)
    past = torch.tensor(CONTEXTS, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    return _best(lambda: [loaded.paged_attention(query, k, v, tables, cu_seqlens, past, scale) for k, v in pools])


def _best(call: Callable[[], object]) -> float:
    """Milliseconds of `call`'s fastest run of `REPEATS`, after a warm-up (pages, caches)."""
    call()
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1000
