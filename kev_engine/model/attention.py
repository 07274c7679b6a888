"""Forward's attention: block-diagonal causal attention over a pack, never a dense T×T mask.

Registered with transformers' `AttentionInterface` under `KEV_ATTENTION`, together with a
mask function that returns None — so transformers never builds a (leaky or O(T²)) mask and
never falls back to its automatic packed-sequence detection, which is skipped whenever a
cache exists. The pass travels in the forward kwargs: the pack as `kev_pack` (a `PackedBatch`,
plain data) and the engine's attention backend as `kev_backend`, bound to its KV pool.

Each segment attends only to its own question: every new token's keys/values are written to
its slot in the pool first (so a question starting after a prefix that an earlier segment of the
same pass computes reads it, layer by layer), then queries see that question's blocks — its
own, or a shared prefix's — plus its own new tokens, causally. How, and in what memory layout,
is the backend's (`platforms`: torch's ops, Kev's compiled CPU kernels, the batch-invariant
kernel, CUDA's paged varlen kernels).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .pack import PackedBatch

KEV_ATTENTION = "kev_varlen"
NO_BACKEND = ("no attention backend: pass the engine's (a platform's `AttentionBackend`; for a pack without "
              "KV memory, kev_engine.platforms.torch_ops.TorchBackend())")


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function for KEV_ATTENTION: segment structure comes from the pack, not a mask."""
    return None


def kev_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: query [1, H, T, D], key/value [1, kvH, T, D] → [1, T, H, D]."""
    batch: PackedBatch | None = kwargs.get("kev_pack")
    if batch is None:
        raise RuntimeError(
            "this model's attention is Kev's packed attention; run it through kev_engine.Engine "
            "(or set model.set_attn_implementation('sdpa') to use it on its own)"
        )
    if attention_mask is not None:
        raise RuntimeError("Kev's packed attention takes no attention mask; the pack defines the segments")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("Kev's packed attention does not soft-cap attention scores")
    window = kwargs.get("sliding_window")
    if window is not None and batch.longest_context > window:  # a window the engine's context never reaches is none
        raise NotImplementedError(
            f"a question of {batch.longest_context} tokens exceeds the model's sliding window of {window}; "
            "Kev's packed attention has no window (an Engine with max_model_len at most the window never does this)")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    backend = kwargs.get("kev_backend")
    if backend is None:
        raise ValueError(NO_BACKEND)
    q, k, v = query[0], key[0], value[0]
    if batch.slot_blocks is not None:  # every segment's new keys go in first: later segments may read them this pass
        backend.write(layer, batch, k, v)
    return backend.attend(layer, batch, q, k, v, scaling)[None], None


def register() -> None:
    """Make KEV_ATTENTION known to transformers (idempotent)."""
    AttentionInterface.register(KEV_ATTENTION, kev_attention)
    AttentionMaskInterface.register(KEV_ATTENTION, _no_mask)


register()
