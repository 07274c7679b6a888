"""Kev's compiled CPU kernels for the decode pass (`csrc/`): built once per machine, then loaded.

One extension holds three kernels, all for what a decode pass does per question on CPU:
  paged_decode  (`paged_decode.cpp`) every decode row's attention over its KV blocks, one call
                per layer. Why: torch's batched decode path (`attention.batched_decode`) spends
                most of its time in one tiny GEMM per (block, kv head); the kernel streams each
                row's blocks once with an online softmax, on torch's own thread pool. Results
                equal the torch path to fp32 rounding (tests compare both against SDPA).
  paged_write   (same file) each pass's new keys/values stored in the pool, one row copy per
                token and kv head, where torch's index_put spends ~50 us a call setting up.
  rows_linear   (`rows_linear.cpp`) float32 Linear products over few rows, for `cpu_linear`:
                MKL's sgemm is tuned for many rows, and a decode pass's products are few rows
                against weights streaming from memory.

How: `torch.utils.cpp_extension.load` (a C++ compiler and ninja; `make setup` builds it with
`kev build-kernel`) with `-march=native`, cached under torch's extensions folder by a name that
hashes the sources, the torch version and this CPU's flags, so a cache shared between different
machines never loads code built for another CPU. The first build takes about a minute; later
engines load it in well under a second.

Modes (`Engine(decode_kernel=...)`, else `KEV_DECODE_KERNEL`, else "auto"):
  "auto"      use the kernels on CPU; if they cannot be built, say why (a warning on the
              "kev" logger) and use torch's ops — same results, slower decode;
  "compiled"  use the kernels or fail with the build's reason;
  "torch"     never build them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("kev")

MODES = ("auto", "compiled", "torch")
ENV_VAR = "KEV_DECODE_KERNEL"
SOURCES = [Path(__file__).resolve().parent / "csrc" / name
           for name in ("paged_decode.cpp", "rows_linear.cpp", "module.cpp")]
# the sources avoid infinities, and rows_linear.cpp turns off reordering for itself: fast-math is safe
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]  # resolves to the libgomp torch already loaded (same soname): one thread pool

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
PagedWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
RowsLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_lock = threading.Lock()
_module: Any = None
_failure: str | None = None  # a failed build is not retried by every engine of the process


def resolve_mode(mode: str | None) -> str:
    """The mode asked for (argument, then environment, then "auto"), checked."""
    value = mode if mode is not None else os.environ.get(ENV_VAR, "auto")
    if value not in MODES:
        source = "decode_kernel" if mode is not None else ENV_VAR
        raise ValueError(f"{source}={value!r} is not allowed; use one of {', '.join(MODES)}")
    return value


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def build_name() -> str:
    """The extension's cache name: new sources, torch or CPU get a new build."""
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    for text in (torch.__version__, _cpu_fingerprint(), " ".join(CFLAGS)):
        digest.update(text.encode())
    return f"kev_paged_decode_{digest.hexdigest()[:16]}"


def _build() -> Any:
    from torch.utils.cpp_extension import _get_build_directory, load

    if shutil.which("ninja") is None:  # the `ninja` wheel (a dependency) puts its binary beside itself
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    name = build_name()
    built = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    if not built.exists():
        log.warning("building Kev's CPU decode kernels for this machine (once; about a minute)")
    return load(name, [str(source) for source in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, verbose=False)


def _load_module() -> Any:
    """The built extension (building it if needed); RuntimeError with the build's reason if it cannot be."""
    global _module, _failure
    with _lock:
        if _module is None:
            if _failure is not None:
                raise RuntimeError(_failure)
            try:
                _module = _build()
            except Exception as exc:  # noqa: BLE001 - compiler missing, headers missing, build error: all say why
                _failure = (f"Kev's CPU decode kernels could not be built ({type(exc).__name__}: "
                            f"{str(exc).strip()[-2000:]}); it needs a C++ compiler and ninja")
                raise RuntimeError(_failure) from exc
        return _module


def load_kernel() -> PagedDecode:
    """The kernel's `paged_decode(query, keys, values, tables, lens, scale)`; builds it if needed.

    Raises RuntimeError with the build's reason when it cannot be built here.
    """
    return _load_module().paged_decode


def load_writer() -> PagedWrite:
    """The same build's `paged_write(keys, values, key, value, block_ids, offsets)`: a pass's new
    keys/values [kv_heads, T, dim] stored at their (block, offset) slots, one row copy each."""
    return _load_module().paged_write


def load_linear() -> RowsLinear:
    """The same build's `rows_linear(input [M, K], weight [N, K])`: input @ weight.T in float32,
    K a multiple of 8, each row's result independent of the other rows (see rows_linear.cpp)."""
    return _load_module().rows_linear


def choose(mode: str | None, device: torch.device, flash_layout: bool) -> PagedDecode | None:
    """The kernel for an engine's pool, or None for the torch path (non-CPU pools, "torch", or an
    "auto" build that failed — with a warning saying why)."""
    mode = resolve_mode(mode)
    if mode == "torch" or flash_layout or device.type != "cpu":
        if mode == "compiled" and (flash_layout or device.type != "cpu"):
            raise ValueError(f"decode_kernel='compiled' is the CPU kernel; this engine's KV pool is on {device}")
        return None
    try:
        return load_kernel()
    except RuntimeError as exc:
        if mode == "compiled":
            raise
        log.warning("%s; decoding with the torch path instead (same results, slower)", exc)
        return None

