"""Attention backends: which kernel reads the KV pool, in which layout — chosen once per engine.

`base`       the interface (`AttentionBackend`: allocate, plan, write, attend) and the table of backends;
`reference`  torch's own ops, the reference ("torch");
`compiled`   Kev's C++ decode kernel and KV writes on CPU ("compiled");
`exact`      Kev's batch-invariant CPU kernel, every row in one call ("exact");
`cuda`       the paged kernels on a GPU (torch's own `varlen_attn`, or the optional flash-attn);
`cuda_graphs` decode passes replayed as CUDA graphs, one per row-count bucket;
`cuda_invariant` with `cuda_triton` — batch invariance on a GPU (fixed-order products and norms).
"""

from __future__ import annotations

from typing import Any

from .base import AttentionBackend
from .compiled import CompiledBackend
from .cuda import CudaBackend
from .exact import ExactBackend
from .reference import TorchBackend


def choose(kernels: Any, paged: CudaBackend | None, exact: bool) -> AttentionBackend:
    """The engine's backend: the paged CUDA kernel where one was chosen (`cuda.choose`), else on CPU
    the batch-invariant kernel, Kev's compiled kernels, or torch's ops (`kernels.choose` gave none)."""
    if paged is not None:
        paged.num_splits = 1 if exact else None  # one key order per query: what invariance needs
        return paged
    if exact:
        return ExactBackend(kernels)
    if kernels is not None:
        return CompiledBackend(kernels)
    return TorchBackend()
