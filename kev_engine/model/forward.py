"""Forward: one packed batch through the model, logits only where they are needed.

`use_cache=False` keeps transformers from creating its own cache (Kev's KV pool is the
attention backend's, which travels beside the pack to `attention.kev_attention`), and explicit
`position_ids` give every question its own positions.
"""

from __future__ import annotations

from typing import Any

import torch

from .pack import PackedBatch


@torch.inference_mode()
def run_model(
    model: torch.nn.Module, batch: PackedBatch, backend: Any, all_logits: bool = False
) -> torch.Tensor:
    """Return fp32 logits: [K, vocab] at `batch.logits_indices`, or [T, vocab] with `all_logits`.

    `backend`: the attention backend `batch` was packed for (for a pack without KV memory,
    `platforms.torch_ops.TorchBackend()`).

    With no index to keep the pass still runs: it fills the KV blocks of prefill chunks.
    """
    keep: int | torch.Tensor = 0 if all_logits else batch.logits_indices
    out = model(
        input_ids=batch.input_ids[None],  # [1, T]
        position_ids=batch.position_ids[None],  # [1, T]
        use_cache=False,
        logits_to_keep=keep,
        kev_pack=batch,
        kev_backend=backend,
    )
    return out.logits[0].float()  # [K or T, vocab]
