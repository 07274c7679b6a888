"""Rotary embeddings as a table: each position's cos/sin computed once, the same in every pass.

Where this sits: each Kev model holds one (`llama.DecoderModel.rope`); a pass looks its
positions up (`Rope.lookup`) and the platform's `rotary` op applies them.

Why a table: torch's elementwise cos/sin finish each thread's share of a tensor with a scalar
loop whose result may differ from the vector one in the last bit, and which positions fall there
depends on the pass's size. Computed `CHUNK` positions at a time, whenever a chunk is first
needed, a position's cos/sin never depend on what else is in the pass. The formula is
transformers' (`LlamaRotaryEmbedding.forward`): frequencies in float32 from the config's rope
parameters (transformers' `ROPE_INIT_FUNCTIONS` for the scaled types: Llama 3's `llama3`,
`linear`, `yarn`), cos and sin times the type's attention factor, then cast to the model's dtype.
Rope types whose frequencies follow the longest sequence of a batch cannot be packed and are
refused (`check`).
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK = 1024  # positions computed per step of the table
BATCH_DEPENDENT = ("dynamic", "longrope")


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope block (`rope_parameters`; older configs: `rope_scaling` and `rope_theta`)."""
    found = getattr(config, "rope_parameters", None)
    if isinstance(found, dict) and found:
        return {"rope_type": "default", **found}
    scaling = getattr(config, "rope_scaling", None) or {}
    return {"rope_type": scaling.get("rope_type", scaling.get("type", "default")), **scaling,
            "rope_theta": getattr(config, "rope_theta", 10000.0)}


def check(config: Any) -> None:
    """Refuse rope types whose frequencies depend on the other sequences of a batch."""
    kind = rope_parameters(config)["rope_type"]
    if kind in BATCH_DEPENDENT:
        raise ValueError(
            f"config.rope_parameters has rope_type={kind!r}, whose frequencies follow the longest sequence in a "
            "batch: packed questions would change each other's positions. Kev packs models with static rotary "
            f"embeddings only (not {', '.join(BATCH_DEPENDENT)})")


class Rope:
    """cos/sin [positions, head_dim] in one dtype on one device, grown CHUNK positions at a time."""

    def __init__(self, config: Any, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        check(config)
        params = rope_parameters(config)
        if params["rope_type"] == "default":
            base = float(params["rope_theta"])
            self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if params["rope_type"] not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"config.rope_parameters has rope_type={params['rope_type']!r}, which transformers "
                                 f"does not know; known: {sorted(ROPE_INIT_FUNCTIONS)}")
            self.inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
        self.dtype, self.device = dtype, device
        self.cos = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.sin = torch.empty(0, head_dim, dtype=dtype, device=device)

    def lookup(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [T] → cos, sin [T, head_dim] (contiguous)."""
        needed = int(position_ids.max()) + 1 if position_ids.numel() else 0
        if needed > self.cos.shape[0]:
            self._grow(needed)
        return self.cos.index_select(0, position_ids), self.sin.index_select(0, position_ids)

    def _grow(self, count: int) -> None:
        cos, sin = [self.cos], [self.sin]
        inv_freq = self.inv_freq.to(device=self.device, dtype=torch.float)
        for start in range(self.cos.shape[0], count, CHUNK):
            positions = torch.arange(start, start + CHUNK, device=self.device)  # [CHUNK]
            freqs = positions[:, None].float() * inv_freq  # [CHUNK, head_dim / 2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [CHUNK, head_dim]
            cos.append((emb.cos() * self.scaling).to(self.dtype))
            sin.append((emb.sin() * self.scaling).to(self.dtype))
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)
