"""The ragged KV cache: one buffer per question, never shared, never padded to a neighbour.

Where this sits: the attention function writes each segment's new keys/values here and
attends over this question's own prefix only. Capacity is known at admission (prompt +
max new tokens, clamped to the context), so each layer's buffer is allocated once.
"""

from __future__ import annotations

import torch


class SequenceKV:
    """Keys and values of one question, per layer: [num_kv_heads, capacity, head_dim]."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.capacity = capacity
        # allocated lazily from the first write, so head counts and dims come from the model itself
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def write(self, layer: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `key`/`value` ([num_kv_heads, n, head_dim]) at positions start..start+n."""
        end = start + key.shape[1]
        assert end <= self.capacity, f"KV write to {end} past capacity {self.capacity}"
        if self.keys[layer] is None:
            shape = (key.shape[0], self.capacity, key.shape[2])
            self.keys[layer] = key.new_empty(shape)
            self.values[layer] = value.new_empty((value.shape[0], self.capacity, value.shape[2]))
        self.keys[layer][:, start:end] = key  # type: ignore[index]
        self.values[layer][:, start:end] = value  # type: ignore[index]

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of positions 0..end: ([num_kv_heads, end, head_dim], same)."""
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None, "KV read before any write"
        return keys[:, :end], values[:, :end]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)
