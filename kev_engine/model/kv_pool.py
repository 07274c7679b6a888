"""KV memory the engine owns: one budgeted pool of fixed-size blocks per layer.

Where this sits: allocated once when the `Engine` starts, by its attention backend
(`platforms.base.AttentionBackend.allocate`), which decides the layout of a block — each backend's
kernel reads its own (see `platforms`) — and alone writes and reads the keys/values in it.
`blocks.BlockManager` decides which question owns (or shares) which block. Nothing outside the
pool ever holds KV, so the budget is the bound. Block b is index b of dim 0 in every layout.
On CPU the tensors come from `torch.empty`: pages the engine never touches are never resident.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..core.blocks import blocks_for

CPU_DEFAULT_MAX_BYTES = 4 << 30
CPU_DEFAULT_FRACTION = 0.2  # of the memory available when the engine starts


def kv_shape(model: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from the model's config."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def available_memory() -> int:
    """Bytes of host memory available now (Linux's MemAvailable, which counts reclaimable page
    cache; elsewhere the free pages)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    return available


def host_kv_cache_bytes() -> int:
    """A sane budget in host memory when the caller gives none: a share of what is available now
    (a platform whose KV lives elsewhere gives its own, `Platform.default_kv_cache_bytes`)."""
    return int(min(CPU_DEFAULT_MAX_BYTES, available_memory() * CPU_DEFAULT_FRACTION))


Shape = tuple[int, ...]
# a backend's block layout: (num_blocks, num_kv_heads, block_size, head_dim) → (key shape, value shape)
Layout = Callable[[int, int, int, int], tuple[Shape, Shape]]


class KVPool:
    """Per-layer key/value block tensors within `kv_cache_bytes`, in the layout a backend asked for."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_bytes: int | None,
        block_size: int,
        layout: Layout,
        useful_tokens: int | None = None,
        default_bytes: Callable[[], int] = host_kv_cache_bytes,
    ) -> None:
        """`useful_tokens`: more KV than this is never useful (every sequence slot at full context,
        twice over for cached prefixes); a default budget (`default_bytes()`) stops there."""
        self.num_layers, self.num_kv_heads, self.head_dim = kv_shape(model)
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is not allowed; use an integer >= 1")
        self.block_size = block_size
        element = torch.empty((), dtype=dtype).element_size()
        # keys + values, every layer, one block
        self.block_bytes = 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * element
        budget = kv_cache_bytes
        if budget is None:
            budget = default_bytes()
            if useful_tokens is not None:
                budget = min(budget, blocks_for(useful_tokens, self.block_size) * self.block_bytes)
        self.num_blocks = int(budget) // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={budget} holds no block; one block of {self.block_size} tokens needs "
                f"{self.block_bytes} bytes on this model"
            )
        self.budget_bytes = self.num_blocks * self.block_bytes
        key_shape, value_shape = layout(self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        self.keys = [torch.empty(key_shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.values = [torch.empty(value_shape, dtype=dtype, device=device) for _ in range(self.num_layers)]

    def reserve_last_block(self) -> int:
        """Take the last block out of the budget (CUDA graphs' padding rows write there); its id."""
        if self.num_blocks < 2:
            raise ValueError(f"kv_cache_bytes={self.budget_bytes} holds {self.num_blocks} block; CUDA graphs need "
                             "one more for padding rows (give more KV memory, or Engine(cuda_graphs=False))")
        self.num_blocks -= 1
        self.budget_bytes = self.num_blocks * self.block_bytes
        return self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def check_new(self, key: torch.Tensor) -> None:
        """New keys [num_kv_heads, T, head_dim], as the model's config says, or an error saying so."""
        if key.shape[0] != self.num_kv_heads or key.shape[2] != self.head_dim:
            raise RuntimeError(
                f"the model produced keys of shape {list(key.shape)}; Kev's KV pool expects "
                f"[{self.num_kv_heads}, T, {self.head_dim}] from its config"
            )

    def zero(self, block_ids: list[int]) -> None:
        """Clear blocks in every layer (stale memory may hold NaN bit patterns, and 0 x NaN is NaN)."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.keys[0].device)
        for keys, values in zip(self.keys, self.values):
            keys.index_fill_(0, index, 0)
            values.index_fill_(0, index, 0)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the KV of each (source, target) block pair, every layer: one indexed copy per tensor."""
        if not pairs:
            return
        device = self.keys[0].device
        source = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
        target = torch.tensor([t for _, t in pairs], dtype=torch.long, device=device)
        for tensor in (*self.keys, *self.values):
            tensor[target] = tensor[source]
