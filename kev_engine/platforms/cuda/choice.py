"""Which CUDA attention an engine gets: read from what this torch has, then tried once on the GPU.

Where this sits: `platforms.choose` asks `choose` once, when an `Engine` starts on a GPU.
Kernels, in the order "auto" tries them:
  "varlen"      torch's own `torch.nn.attention.varlen.varlen_attn`, in the form its signature
                shows (`varlen_kernel`): paged (`block_table`, `seqused_k`, `num_splits`,
                `enable_gqa`: torch 2.12 and later) → `varlen.CudaBackend`, one call over the
                pool, decode graphs; contiguous keys only (torch 2.10 and 2.11, causal asked by
                `window_size` or `is_causal`) → `gathered.GatheredBackend`, which copies each
                segment's cached keys/values out of the pool per layer, without decode graphs.
                Nothing to build or install.
  "triton"      Kev's own paged kernel (`triton_paged.TritonBackend`): the pool in place and decode
                graphs on every torch with Triton. "auto" tries it before the gathered form, which
                it replaces where torch's varlen_attn is not paged.
  "flash-attn"  the optional `flash-attn` package's `flash_attn_varlen_func(block_table=...)`.
A signature is read from the installed torch, never assumed from a version number; and before a
kernel is used, `probe.contract_error` runs it on a tiny pack against attention computed per
segment, so a kernel whose parameters read right but compute otherwise (another causal
alignment, no grouped heads) is refused with the difference it showed, not trusted.
Neither usable: "auto" says why (a warning on the "kev" logger) and attention runs on torch's
SDPA per segment with the CPU pool layout; naming a kernel that cannot run is an error.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from . import probe
from .gathered import GatheredBackend
from .varlen import CudaBackend, VarlenBackend

log = logging.getLogger("kev")

MODES = ("auto", "varlen", "triton", "flash-attn", "torch")
PAGED_PARAMETERS = ("block_table", "seqused_k", "num_splits", "enable_gqa", "window_size")
CAUSAL_PARAMETERS = ("window_size", "is_causal")  # how the contiguous form is asked for causal attention
HALF = (torch.float16, torch.bfloat16)


def varlen_kernel() -> tuple[Callable[..., Any] | None, str | None, str | None]:
    """torch's `varlen_attn` and its form, "paged" or "gathered" (contiguous keys only), read from
    its signature; else (None, None, why not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, None, (f"torch {torch.__version__} has no torch.nn.attention.varlen "
                            "(varlen_attn is in torch 2.10 and later)")
    return (varlen_attn, *form_of(varlen_attn))


def form_of(function: Callable[..., Any]) -> tuple[str | None, str | None]:
    """("paged" | "gathered", None) from a varlen_attn's signature, or (None, why neither)."""
    signature = inspect.signature(function)
    parameters = signature.parameters
    if all(name in parameters for name in PAGED_PARAMETERS):
        return "paged", None
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 7 and any(name in parameters for name in CAUSAL_PARAMETERS):
        return "gathered", None
    return None, (f"torch {torch.__version__}'s varlen_attn{signature} has neither the paged form "
                  f"({', '.join(PAGED_PARAMETERS)}) nor (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k) with "
                  "window_size or is_causal")


def flash_attn_function() -> tuple[Callable[..., Any] | None, str | None]:
    """The optional flash-attn package's paged varlen function, else (None, why not)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 - a broken build fails to import in many ways
        return None, f"the flash-attn package cannot be imported ({type(exc).__name__}: {exc})"
    return flash_attn_varlen_func, None


def triton_backend() -> tuple[VarlenBackend | None, str | None]:
    """Kev's Triton paged attention, else (None, why Triton cannot load)."""
    try:
        from .triton_paged import TritonBackend
    except Exception as exc:  # noqa: BLE001 - Triton missing, or built for another torch
        return None, f"Triton cannot be imported ({type(exc).__name__}: {exc}); install triton"
    return TritonBackend(), None


def why_not_triton_device(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why Kev's Triton attention cannot run for a model on `device` in `dtype`, or None."""
    if device.type != "cuda":
        return f"the model is on {device}; Kev's Triton attention runs on CUDA only"
    if dtype not in (torch.float32, *HALF):
        return f"the model is in {dtype}; Kev's Triton attention computes float32, float16 and bfloat16"
    major, minor = torch.cuda.get_device_capability(device)
    if dtype == torch.bfloat16 and major < 8:
        return f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; bfloat16 tensor cores need sm_80 or newer"
    return None


def why_not_device(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why flash attention cannot run for a model on `device` in `dtype`, or None."""
    if device.type != "cuda":
        return f"the model is on {device}; the varlen kernels run on CUDA only"
    if dtype not in HALF:
        return f"the model is in {dtype}; flash attention computes float16 and bfloat16 (load with dtype='auto')"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; flash attention needs sm_80 or newer"
    return None


def backend_for(name: str, function: Callable[..., Any], form: str) -> VarlenBackend:
    """The backend that calls `function` in its `form`."""
    return GatheredBackend(function) if form == "gathered" else CudaBackend(name, function)


KERNELS = ("varlen", "triton", "flash-attn")  # the order "auto" tries them in (the gathered form after triton)


def candidate(name: str, device: torch.device, dtype: torch.dtype) -> tuple[VarlenBackend | None, str | None]:
    """The backend of kernel `name` for a model on `device` in `dtype`, or (None, why it cannot run)
    — from what is installed, before the probe."""
    if name == "varlen":
        function, form, why = varlen_kernel()
        backend = backend_for(name, function, form) if why is None and function and form else None
        return backend, why or why_not_device(device, dtype)
    if name == "triton":
        why = why_not_triton_device(device, dtype)
        return (None, why) if why is not None else triton_backend()
    function, why = flash_attn_function()
    return (CudaBackend(name, function) if function is not None else None), why or why_not_device(device, dtype)


def resolve_mode(mode: str | None) -> str:
    mode = "auto" if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"cuda_attention={mode!r} is not allowed; use one of {list(MODES)}")
    return mode


def choose(mode: str | None, device: torch.device, dtype: torch.dtype) -> VarlenBackend | None:
    """The attention kernel for an engine on `device`, or None for torch's SDPA path (CPU engines,
    "torch", or an "auto" engine where no kernel can run — with a warning saying why)."""
    mode = resolve_mode(mode)
    if mode == "torch":
        return None
    if device.type != "cuda":
        if mode != "auto":
            raise ValueError(f"cuda_attention={mode!r} names a CUDA kernel; this engine runs on {device}")
        return None
    candidates = {name: candidate(name, device, dtype) for name in (KERNELS if mode == "auto" else (mode,))}
    order = list(candidates)
    varlen = candidates.get("varlen", (None, None))[0]
    if mode == "auto" and varlen is not None and varlen.form == "gathered":
        order = ["triton", "varlen", "flash-attn"]  # the pool in place and graphs before a gather per layer
    reasons = []
    for name in order:
        backend, why = candidates[name]
        if why is None:
            assert backend is not None
            why = probe.contract_error(backend, device, dtype)
            if why is None:
                if backend.form == "gathered":
                    log.info("Kev: torch %s's varlen_attn reads contiguous keys: each layer gathers every "
                             "segment's cached keys/values from the pool (no decode graphs; torch 2.12 and later "
                             "read the pool in place, as Kev's Triton attention does)", torch.__version__)
                return backend
        if mode == name:
            raise ValueError(f"cuda_attention={name!r} cannot be honoured: {why}")
        reasons.append(f"{name}: {why}")
    log.warning("Kev: no paged CUDA attention (%s); attention runs on torch's SDPA per segment, without CUDA "
                "graphs and not batch-invariant", "; ".join(reasons))
    return None
