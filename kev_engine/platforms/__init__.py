"""Platforms: everything that depends on the device — chosen once per engine, in one place.

`choose` returns the engine's `Platform` (`base`): CPU (`cpu/`: Kev's compiled kernels, batch-
invariant where they cover the model), CUDA (`cuda/`: torch's varlen attention, decode graphs,
Triton for invariance), or torch's own ops on any other device (`torch_ops`). `invariance`
decides and says why not; `inplace` is the elementwise work every platform installs; `threads`
sets the process's compute threads and runs loads on threads that end. The rest of
the engine asks the platform and never the device: `resolve_device`, `default_dtype` and
`carry_thread_state` are the device questions asked before an engine exists. The attention
backends and their block layouts are tabled in `base`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..model.kv_pool import available_memory
from . import inplace, invariance
from .base import AttentionBackend, Platform
from .cpu import dtype_choice, exact_linear, kernels, rotary_table, rows_linear
from .cpu.platform import CpuPlatform
from .cpu.platform import why_not_invariant as cpu_why_not
from .cuda import choice as cuda_choice
from .cuda import invariant as cuda_invariant
from .cuda.platform import CudaPlatform
from .torch_ops import TorchPlatform

__all__ = ["AttentionBackend", "Platform", "auto_dtype", "carry_thread_state", "choose", "default_dtype",
           "resolve_device", "stored_or_dense", "uninstall", "why_not_quantized"]


def choose(model: nn.Module, *, cpu_kernels: str | None, batch_invariant: bool | None, cuda_attention: str | None,
           cuda_graphs: bool) -> Platform:
    """The platform for an engine on `model`'s device; a bad mode, a failed "compiled" build or
    invariance asked for and impossible raise before anything about the model changes."""
    parameter = next(model.parameters())
    device = parameter.device
    paged = cuda_choice.choose(cuda_attention, device, parameter.dtype)
    if paged is not None or device.type == "cuda":
        kernels.choose(cpu_kernels, device, flash_layout=True)  # checks the mode: "compiled" is an error here
        exact = invariance.decide(batch_invariant, lambda: cuda_invariant.why_not(model, paged),
                                  quiet=device.type != "cuda")  # quiet: the paged path emulated on CPU
        return CudaPlatform(device, paged, exact, cuda_graphs)
    cpu = kernels.choose(cpu_kernels, device, flash_layout=False)
    if device.type != "cpu":
        exact = invariance.decide(
            batch_invariant, lambda: f"the model is on {device}; Kev's batch-invariant kernels run on CPU", quiet=True)
        return TorchPlatform(device, exact)
    exact = invariance.decide(batch_invariant, lambda: cpu_why_not(model, cpu, parameter), quiet=cpu is None)
    return CpuPlatform(device, cpu, exact)


def uninstall(model: nn.Module) -> None:
    """Every platform's forwards off a transformers model (the fallback): it computes as it came."""
    rows_linear.uninstall(model)
    exact_linear.uninstall(model)
    cuda_invariant.uninstall(model)
    rotary_table.uninstall(model)
    inplace.uninstall(model)


def resolve_device(device: str | torch.device | None, indexed: bool = False) -> torch.device:
    """The device a model loads on: CUDA where it is available, else the CPU (None), or the one named.
    `indexed`: "cuda" as the current CUDA device's index ("cuda:0"), so that two spellings of one
    device are one (the integrations' shared engines are keyed by it)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use 'cpu' or None")
    if indexed and resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """`dtype="auto"` on `device`, and why: bfloat16 on CUDA; on a CPU, bfloat16 only where Kev's
    products were measured faster in it than in float32 (`cpu.dtype_choice`); else float32."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA computes bfloat16 natively"
    if device.type == "cpu":
        choice = dtype_choice.choose()
        return getattr(torch, choice.dtype), choice.reason
    return torch.float32, f"no measured bfloat16 path on {device.type}"


def why_not_quantized(device: torch.device, dtype: torch.dtype, cpu_kernels: str | None,
                      batch_invariant: bool | None) -> str | None:
    """Why an engine of these settings cannot compute a GGUF's quantized weights as stored (they
    are computed by Kev's batch-invariant CPU kernels, csrc/quant.cpp), or None where it can."""
    if device.type != "cpu":
        return f"the engine runs on {device}"
    if batch_invariant is False:
        return "batch_invariant=False"
    if dtype not in exact_linear.DTYPES:
        return f"dtype={str(dtype).removeprefix('torch.')} (they compute float32 and bfloat16)"
    if kernels.resolve_mode(cpu_kernels) == "torch":
        return "cpu_kernels='torch'"
    try:
        kernels.load_kernels()
    except RuntimeError as exc:
        return str(exc)
    return None


MEMORY_SHARE = 0.5  # of the memory available, the most dense weights may take under weights="auto"


def stored_or_dense(dense_bytes: int, dtype: torch.dtype) -> tuple[str, str]:
    """("as-stored" or "dense", why) for a GGUF whose weights take `dense_bytes` in `dtype`, as
    measured (docs/benchmarks.md, "A prompt's rows on the decoded weights" and "Block-scaled
    quantized products"): on every path a CPU takes by itself, batches ran as fast or faster on
    dense weights than on the file's blocks (a prompt's rows compute on the weights decoded, at
    dense's rate; a decode pass of many questions' generated rows stays slower on the blocks), while
    one question at a time ran faster on the blocks (a decode step reads a third of the bytes); on
    a build without AVX-512 the blocks' products take a lane at a time and everything ran faster
    dense. Kev is built for batches, so dense where the dense
    weights fit in MEMORY_SHARE of the memory available, else as stored (the file's size: a model
    that would not fit dense still runs). `weights="as-stored"` asks for the blocks."""
    from .cpu import kernels as cpu_kernels

    if cpu_kernels.load_kernels().quant_path == "avx512":
        faster = ("batches measured faster on dense weights than on the file's blocks (one question at a time "
                  "runs faster on them: weights='as-stored')")
    else:
        faster = "this build's block-scaled products take a lane at a time (no AVX-512): dense weights ran faster"
    available = available_memory()
    size = f"its weights in {str(dtype).removeprefix('torch.')} ({dense_bytes / 1e9:.2f} GB)"
    if dense_bytes > MEMORY_SHARE * available:
        return "as-stored", (f"{size} would take more than {MEMORY_SHARE:.0%} of the memory available "
                             f"({available / 1e9:.1f} GB); the file's blocks take its size")
    return "dense", f"{size} fit in memory ({available / 1e9:.1f} GB available), where {faster}"


def default_dtype(device: torch.device) -> torch.dtype:
    """`dtype="auto"` on `device` (`auto_dtype`)."""
    return auto_dtype(device)[0]


def carry_thread_state() -> Callable[[], None]:
    """What a new thread runs first to compute as the calling thread would: the caller's CUDA
    device (thread-local in torch), so `device=None` resolves there as it would here."""
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    if device is None:
        return lambda: None
    return lambda: torch.cuda.set_device(device)
