"""KV memory the engine owns: one budgeted pool of fixed-size blocks per layer.

Where this sits: allocated once when the `Engine` starts; `blocks.BlockManager` decides which
question owns (or shares) which block, `attention` writes each new token's keys/values into its
slot and reads them back. Nothing outside the pool ever holds KV, so the budget is the bound.

Layout per layer: keys and values of shape [num_blocks, num_kv_heads, block_size, head_dim] on
CPU, so one block of one head is a contiguous [block_size, head_dim] matrix that the compiled
decode kernel streams (or a batched matmul reads in place); the paged CUDA kernels (torch's
`varlen_attn`, flash-attn: `backends.cuda`) want [num_blocks, block_size, num_kv_heads, head_dim].
An "exact" pool (the batch-invariant attention, csrc/attention.cpp) keeps each block's keys
transposed, [num_blocks, num_kv_heads, head_dim, block_size], so one head dimension of a block's
positions is one vector load.
On CPU the tensors come from `torch.empty`: pages the engine never touches are never resident.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .blocks import blocks_for

CPU_BLOCK_SIZE = 32  # tokens per block: prefixes are shared in whole blocks
FLASH_BLOCK_SIZE = 256  # flash attention's paged KV (varlen_attn, flash-attn) needs a multiple of 256
CPU_DEFAULT_MAX_BYTES = 4 << 30
CPU_DEFAULT_FRACTION = 0.2  # of the memory available when the engine starts
CUDA_DEFAULT_FRACTION = 0.5  # of the device memory still free after the model loaded


def kv_shape(model: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from the model's config."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def default_kv_cache_bytes(device: torch.device) -> int:
    """A sane budget when the caller gives none: a share of what the device has free now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_DEFAULT_FRACTION)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as meminfo:  # MemAvailable counts reclaimable page cache; AVPHYS does not
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    return int(min(CPU_DEFAULT_MAX_BYTES, available * CPU_DEFAULT_FRACTION))


class KVPool:
    """Per-layer key/value block tensors within `kv_cache_bytes`."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_bytes: int | None = None,
        block_size: int | None = None,
        flash_layout: bool = False,
        useful_tokens: int | None = None,
        kernels: Any = None,
        exact: bool = False,
    ) -> None:
        """`useful_tokens`: more KV than this is never useful (every sequence slot at full context,
        twice over for cached prefixes); a default budget stops there. `kernels`: Kev's compiled
        CPU kernels (`kernels.Kernels`) or None for torch's ops; `exact`: the pool serves the
        batch-invariant attention (`self.exact` is then those kernels)."""
        self.num_layers, self.num_kv_heads, self.head_dim = kv_shape(model)
        self.flash_layout = flash_layout
        self.paged_attention: Any = None  # the CUDA kernel that reads this layout (backends.cuda), set by the engine
        if exact and (kernels is None or flash_layout):
            raise ValueError("an exact KV pool needs Kev's compiled CPU kernels")
        self.exact = kernels if exact else None
        # how decode rows read a classic CPU pool: the compiled kernel, or None for the torch path
        self.paged_decode = kernels.paged_decode if kernels is not None and not exact else None
        # the same builds store new keys/values: a row copy each, not two index_put calls a layer
        self._paged_write = None if kernels is None else (
            kernels.paged_write_transposed if exact else kernels.paged_write)
        self.block_size = block_size or (FLASH_BLOCK_SIZE if flash_layout else CPU_BLOCK_SIZE)
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} is not allowed; use an integer >= 1")
        element = torch.empty((), dtype=dtype).element_size()
        # keys + values, every layer, one block
        self.block_bytes = 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * element
        budget = kv_cache_bytes
        if budget is None:
            budget = default_kv_cache_bytes(device)
            if useful_tokens is not None:
                budget = min(budget, blocks_for(useful_tokens, self.block_size) * self.block_bytes)
        self.num_blocks = int(budget) // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={budget} holds no block; one block of {self.block_size} tokens needs "
                f"{self.block_bytes} bytes on this model"
            )
        self.budget_bytes = self.num_blocks * self.block_bytes
        if exact and self.block_size % 16:
            raise ValueError(f"block_size={self.block_size} is not allowed for the batch-invariant attention; "
                             "use a multiple of 16")
        if flash_layout:
            shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        else:
            shape = (self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        key_shape = (self.num_blocks, self.num_kv_heads, self.head_dim, self.block_size) if exact else shape
        self.keys = [torch.empty(key_shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]

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

    def write(
        self, layer: int, block_ids: torch.Tensor, offsets: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store new keys/values [num_kv_heads, T, head_dim] at their slots (block_ids[t], offsets[t])."""
        if key.shape[0] != self.num_kv_heads or key.shape[2] != self.head_dim:
            raise RuntimeError(
                f"the model produced keys of shape {list(key.shape)}; Kev's KV pool expects "
                f"[{self.num_kv_heads}, T, {self.head_dim}] from its config"
            )
        if self.flash_layout:
            self.keys[layer][block_ids, offsets] = key.transpose(0, 1)  # [T, kvH, D]
            self.values[layer][block_ids, offsets] = value.transpose(0, 1)
        elif self._paged_write is not None:
            self._paged_write(self.keys[layer], self.values[layer], key, value, block_ids, offsets)
        else:
            self.keys[layer][block_ids, :, offsets] = key.transpose(0, 1)
            self.values[layer][block_ids, :, offsets] = value.transpose(0, 1)

    def zero(self, block_ids: list[int]) -> None:
        """Clear blocks just handed out, in every layer (stale memory may hold NaN bit patterns).

        The torch decode path and flash attention read whole blocks and mask the slots past a row's
        length, and 0 x NaN is NaN; the compiled kernels read (or select) only each row's own
        tokens, so a pool they serve skips this work on the steps that take new blocks.
        """
        if not block_ids or self._paged_write is not None:
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.keys[0].device)
        for keys, values in zip(self.keys, self.values):
            keys.index_fill_(0, index, 0)
            values.index_fill_(0, index, 0)

    def gather(self, layer: int, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One question's keys/values over its blocks, positions 0..length: [num_kv_heads, length, head_dim]."""
        assert not self.flash_layout and self.exact is None
        keys = self.keys[layer][block_ids]  # [n, kvH, bs, D]
        values = self.values[layer][block_ids]
        n = keys.shape[0]
        flat_k = keys.transpose(0, 1).reshape(self.num_kv_heads, n * self.block_size, self.head_dim)
        flat_v = values.transpose(0, 1).reshape(self.num_kv_heads, n * self.block_size, self.head_dim)
        return flat_k[:, :length], flat_v[:, :length]
