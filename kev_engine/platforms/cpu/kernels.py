"""Kev's compiled CPU kernels (`csrc/`): built once per environment, then loaded as one `Kernels` object.

Two builds, each with the compiler flags its sources need:
  exact  (`linear.cpp`, `quant.cpp`, `attention.cpp`, `elementwise.cpp`, `rows_linear.cpp`) — no
         fast-math, no implicit contraction: the batch-invariant path. Every value is computed by
         the operations written in the source, in the order written, whatever else is in the pass:
         Linear products from packed weights (`linear_pack`, `linear_packed`) and from a GGUF's
         quantized blocks (`quant_linear`, `quant_rows`), attention for every
         row of a pass over the paged pool (`paged_attention`, `paged_write_transposed`), the
         MLP's activation (`silu_mul`), RMSNorm (`rms_norm`), rotary embeddings (`rotary`), the
         residual additions of a decoder layer in one call (`add_into`, `DecoderLayer`), and the
         few-row float32 product of the non-invariant path (`rows_linear`).
  fast   (`paged_decode.cpp`) — -ffast-math: decode attention and KV writes of the non-invariant
         path (`paged_decode`, `paged_write`), equal to torch's ops up to fp32 rounding.

How: `torch.utils.cpp_extension.load` (a C++ compiler and ninja; `make setup` runs it through
`kev build-kernel`) with `-march=native`, less what `KEV_CPU_ISA` turns off (`isa`: AMX,
or all of AVX-512, so one machine can build and test the paths of smaller CPUs). Each build
lives in its own folder under `KEV_CACHE_DIR/kernels` (default `~/.cache/kev/kernels`), named by
a hash of its sources, flags (the `KEV_CPU_ISA` level's included), the torch version, this
CPU's flags and the environment's `toolchain()` (its paths are in ninja's command lines, and ninja
rebuilds when a command line changes), with the sources copied in: any checkout in an environment
finds that environment's build, each virtual environment sharing the cache has its own and never
rebuilds another's, and a cache shared between machines never loads code built for another CPU.
A build says so on the "kev" logger and every 15 s while it runs; a process that finds another
one in its folder (`build_lock`) waits for it and says whose build it waits for and why. When the
builds load, the path of bfloat16 products is fixed for the process (`dtype_choice.choose_bf16_path`:
AMX, or on a CPU without it the faster of AVX512-BF16 and fused multiply-adds, measured once).

Modes (`Engine(cpu_kernels=...)`, else `KEV_CPU_KERNELS`, else "auto"):
  "auto"      use the kernels on CPU; if they cannot be built, say why (a warning on the
              "kev" logger) and use torch's ops — not batch-invariant, slower decode;
  "compiled"  use the kernels or fail with the build's reason;
  "torch"     never build them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from . import build_lock
from . import isa as cpu_isa

log = logging.getLogger("kev")

MODES = ("auto", "compiled", "torch")
ENV_VAR = "KEV_CPU_KERNELS"
CSRC = Path(__file__).resolve().parent / "csrc"
# sources, headers and flags of each build; the exact build must never reassociate or contract
BUILDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "exact": (("linear.cpp", "quant.cpp", "quant_scaled.cpp", "attention.cpp", "elementwise.cpp", "rows_linear.cpp",
               "layer.cpp", "bind_exact.cpp"),
              ("simd.h", "exact.h", "pool.h", "quant_blocks.h"),
              ("-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-fopenmp")),
    "fast": (("paged_decode.cpp", "bind_fast.cpp"), ("pool.h",),
             ("-O3", "-march=native", "-ffast-math", "-fopenmp")),
}
LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname); Kev's threads are pool.h's
PROGRESS_EVERY_S = 15.0

_lock = threading.Lock()
_kernels: Kernels | None = None
_failure: str | None = None  # a failed build is not retried by every engine of the process


class Kernels:
    """The loaded builds' functions (see each source file for its contract)."""

    def __init__(self, exact: Any, fast: Any, bf16_path: Any) -> None:
        self.linear_pack = exact.linear_pack
        self.linear_packed = exact.linear_packed
        self.bf16_path = bf16_path  # `dtype_choice.PathChoice`: the path bf16 products take, and why
        self.set_bf16_path = exact.set_bf16_path  # refused once a product ran on another path
        self.linear_paths: str = exact.linear_paths()
        self.quant_linear = exact.quant_linear  # products on GGUF's quantized weights (quant.cpp)
        self.quant_rows = exact.quant_rows
        self.quant_path: str = exact.quant_path()  # "avx512" register tiles, or "scalar" (no AVX-512 here)
        # whether a prompt's rows take the decoded weights' arithmetic (quant.cpp): a build with AVX512-BF16
        self.quant_prompt_decoded: bool = exact.quant_prompt_decoded()
        self.paged_attention = exact.paged_attention
        self.paged_write_transposed = exact.paged_write_transposed
        self.silu_mul = exact.silu_mul
        self.rms_norm = exact.rms_norm
        self.rotary = exact.rotary
        self.add_into = exact.add_into  # the one-call layer's residual additions
        self.rows_linear = exact.rows_linear
        self.DecoderLayer = exact.DecoderLayer
        self.Product = exact.Product  # a DecoderLayer's product: packed or quantized
        self.layers_forward = exact.layers_forward  # consecutive DecoderLayers in one call
        self.paged_decode = fast.paged_decode
        self.paged_write = fast.paged_write
        self.serial_torch_here = exact.serial_torch_here
        self._builds = (exact, fast)

    def set_threads(self, threads: int) -> None:
        """Every build's kernels on `threads` threads from now on (csrc/pool.h); process-wide."""
        for build in self._builds:
            build.set_threads(threads)


def resolve_mode(mode: str | None) -> str:
    """The mode asked for (argument, then environment, then "auto"), checked."""
    source = "cpu_kernels" if mode is not None else ENV_VAR
    value = mode if mode is not None else os.environ.get(source, "auto")
    if value not in MODES:
        raise ValueError(f"{source}={value!r} is not allowed; use one of {', '.join(MODES)}")
    return value


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the machine and its CPU flags (the line as it is, all of it)."""
    return f"{platform.machine()} {platform.processor()} {cpu_isa.flags_line()}"


def build_flags(build: str) -> tuple[str, ...]:
    """A build's compiler flags: its own, then what `KEV_CPU_ISA` turns off of -march=native."""
    return BUILDS[build][2] + cpu_isa.compiler_flags()


def toolchain() -> tuple[str, ...]:
    """What torch writes into a build's command lines besides Kev's flags and the build's name: the
    compiler, torch's and Python's headers and torch's libraries, as this environment has them."""
    from torch.utils import cpp_extension

    python_include = sysconfig.get_path("include", scheme="posix_prefix") or ""  # the path torch passes
    return (cpp_extension.get_cxx_compiler(), *cpp_extension.include_paths("cpu"), python_include,
            *cpp_extension.library_paths("cpu"))


def build_name(build: str) -> str:
    """A build's folder name: new sources, flags (`KEV_CPU_ISA` included), torch, CPU or environment
    (`toolchain`) get a new build, so no environment opens another's folder and makes ninja rebuild it."""
    sources, headers, _ = BUILDS[build]
    flags = build_flags(build)
    digest = hashlib.sha256()
    for name in (*sources, *headers):
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    for text in (torch.__version__, _cpu_fingerprint(), " ".join(flags), "\0".join(toolchain())):
        digest.update(text.encode())
    return f"kev_{build}_{digest.hexdigest()[:16]}"


def build_root() -> Path:
    return Path(os.environ.get("KEV_CACHE_DIR") or Path.home() / ".cache" / "kev") / "kernels"


@contextlib.contextmanager
def _progress(name: str) -> Iterator[None]:
    """Say every PROGRESS_EVERY_S seconds that a build is still running."""
    done = threading.Event()
    started = time.monotonic()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            log.warning("still building Kev's CPU kernels (%s): %.0f s so far", name, time.monotonic() - started)

    thread = threading.Thread(target=report, name="kev-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        log.warning("built Kev's CPU kernels (%s) in %.0f s", name, time.monotonic() - started)


def _build(build: str) -> Any:
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # the `ninja` wheel (a dependency) puts its binary beside itself
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    name = build_name(build)
    sources, headers, _ = BUILDS[build]
    flags = build_flags(build)
    folder = build_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    with build_lock.hold(folder, name, PROGRESS_EVERY_S) as note:
        # torch's own lock file (`lock`, left behind by a build that was killed) would make every later
        # load wait forever without a word; holding this lock, no other Kev process builds here
        (folder / "lock").unlink(missing_ok=True)
        for source in (*sources, *headers):  # the build reads copies: its paths are the same for every checkout
            copy = folder / source
            if not copy.exists() or copy.read_bytes() != (CSRC / source).read_bytes():
                shutil.copyfile(CSRC / source, copy)
        built = (folder / f"{name}.so").exists()
        if not built:
            note("building it")
            log.warning("building Kev's CPU kernels (%s) for this machine and environment, once (a few minutes)", name)
        with _progress(name) if not built else contextlib.nullcontext():
            # fresh lists: torch appends its own flags to them, and a shared one would change the link line
            return load(name, [str(folder / s) for s in sources], extra_cflags=list(flags), extra_ldflags=list(LDFLAGS),
                        build_directory=str(folder), verbose=False)


def load_kernels() -> Kernels:
    """Both builds (building them if needed); RuntimeError with the build's reason if they cannot be."""
    global _kernels, _failure
    with _lock:
        if _kernels is None:
            if _failure is not None:
                raise RuntimeError(_failure)
            try:
                exact, fast = _build("exact"), _build("fast")
            except Exception as exc:  # noqa: BLE001 - compiler missing, headers missing, build error: all say why
                _failure = (f"Kev's CPU kernels could not be built ({type(exc).__name__}: "
                            f"{str(exc).strip()[-2000:]}); they need a C++ compiler and ninja")
                raise RuntimeError(_failure) from exc
            from . import dtype_choice  # imports this module: it measures on these kernels

            _kernels = Kernels(exact, fast, dtype_choice.choose_bf16_path(exact))  # before any product runs
        return _kernels


def loaded() -> Kernels | None:
    """The kernels if this process has loaded them; never builds."""
    return _kernels


def choose(mode: str | None, device: torch.device, flash_layout: bool) -> Kernels | None:
    """The kernels for an engine on `device`, or None for torch's ops (non-CPU engines, "torch",
    or an "auto" build that failed — with a warning saying why)."""
    mode = resolve_mode(mode)
    if mode == "torch" or flash_layout or device.type != "cpu":
        if mode == "compiled" and (flash_layout or device.type != "cpu"):
            raise ValueError(f"cpu_kernels='compiled' names Kev's CPU kernels; this engine runs on {device}")
        return None
    try:
        return load_kernels()
    except RuntimeError as exc:
        if mode == "compiled":
            raise
        log.warning("%s; running on torch's ops instead (not batch-invariant, slower decode)", exc)
        return None
