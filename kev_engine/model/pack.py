"""Pack: the scheduled chunks of many questions → one flat sequence the model runs at once.

Each segment is one question's new tokens this pass; `position_ids` continue that question's
own count (restarting at 0 for a fresh prompt), `cu_seqlens` marks where segments start and
end, `past_lens` says how much of each question is already in KV blocks, and the slot mapping
says where each new token's keys/values go. What the attention kernel needs beyond that (block
tables, decode row groups) is the engine's attention backend's to add (`platforms`), as plain
data in `PackedBatch.attention`. Plain Python list-building, then one host→device copy per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.blocks import blocks_for


@dataclass
class Segment:
    """One question's share of a pass: `token_ids` follow `past_len` tokens already in `block_ids`."""

    request_id: int
    token_ids: list[int]
    past_len: int
    needs_logits: bool
    block_ids: list[int] = field(default_factory=list)  # covering past_len + len(token_ids) tokens
    adapter: str | None = None
    all_logits: bool = False  # logits at every new token (prompt_logits), not only the last
    prompt_rows: int = 0  # of token_ids, how many lead as its prompt's tokens (the rest it generated)

    @property
    def end(self) -> int:
        """Tokens this segment attends to once its new ones are in: past_len + its new tokens."""
        return self.past_len + len(self.token_ids)


@dataclass
class PackedBatch:
    """What one forward pass sees. T = total new tokens, S = segments."""

    input_ids: torch.Tensor  # [T] long
    position_ids: torch.Tensor  # [T] long, restarting per question
    cu_seqlens: torch.Tensor  # [S+1] int32, segment boundaries in the flat sequence
    cu_seqlens_list: list[int]  # the same on the host, to slice without a device sync
    past_lens: list[int]  # [S] tokens already in KV blocks per segment
    max_seqlen: int  # longest segment this pass (flash-attn's max_seqlen_q)
    logits_indices: torch.Tensor  # [K] flat index of each token that needs logits
    logits_rows: list[tuple[int, int]]  # [S] this segment's rows of the [K, vocab] logits
    request_ids: list[int]  # [S]
    adapters: list[str | None]  # [S]
    block_tables: list[list[int]] = field(default_factory=list)  # [S]
    slot_blocks: torch.Tensor | None = None  # [T] long: block of each new token's K/V; None = no KV pool
    slot_offsets: torch.Tensor | None = None  # [T] long: its position inside that block
    attention: Any = None  # the backend's metadata for this pass (its `plan`): plain data, no pool
    prompt_rows: list[int] = field(default_factory=list)  # [S] each segment's leading prompt rows
    # [T] bool: the rows that are a prompt's tokens (None: no row), for products whose arithmetic
    # depends on what a row is (`Ops.linear`'s `prompt`)
    prompt: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_list[-1]

    @property
    def num_segments(self) -> int:
        return len(self.request_ids)

    @property
    def longest_context(self) -> int:
        """The most tokens any segment attends to: its past and its new tokens."""
        return max(past + b - a for past, a, b in zip(self.past_lens, self.cu_seqlens_list, self.cu_seqlens_list[1:]))

    def segment_lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.cu_seqlens_list, self.cu_seqlens_list[1:])]


def pack(segments: Sequence[Segment], device: torch.device | str = "cpu", backend: Any = None) -> PackedBatch:
    """Concatenate the segments; logits are kept only where a segment needs them.

    `backend`: the engine's attention backend, bound to its KV pool (`platforms.base`): it adds each
    new token's slot and its own metadata. None: a prefill-only pack with no memory (tests, drawings).
    """
    if not segments:
        raise ValueError("pack() needs at least one segment")
    pool = backend.pool if backend is not None else None
    input_ids: list[int] = []
    position_ids: list[int] = []
    cu_seqlens = [0]
    logits_indices: list[int] = []
    logits_rows: list[tuple[int, int]] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    prompt: list[bool] = []
    block_size = pool.block_size if pool is not None else 0
    for seg in segments:
        assert seg.token_ids, f"empty segment for request {seg.request_id}"
        assert 0 <= seg.prompt_rows <= len(seg.token_ids), f"request {seg.request_id}: prompt_rows out of range"
        start = len(input_ids)
        input_ids.extend(seg.token_ids)
        positions = range(seg.past_len, seg.end)
        position_ids.extend(positions)
        cu_seqlens.append(len(input_ids))
        prompt.extend([True] * seg.prompt_rows + [False] * (len(seg.token_ids) - seg.prompt_rows))
        first = len(logits_indices)
        if seg.all_logits:
            logits_indices.extend(range(start, len(input_ids)))
        elif seg.needs_logits:
            logits_indices.append(len(input_ids) - 1)
        logits_rows.append((first, len(logits_indices)))
        if pool is not None:
            assert len(seg.block_ids) * block_size >= positions.stop, f"request {seg.request_id} lacks KV blocks"
            slot_blocks.extend(seg.block_ids[p // block_size] for p in positions)
            slot_offsets.extend(p % block_size for p in positions)
    if pool is None and any(seg.past_len for seg in segments):
        raise ValueError("a segment continues cached tokens, so the pack needs the engine's KV pool")

    def tensor(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return PackedBatch(
        input_ids=tensor(input_ids),
        position_ids=tensor(position_ids),
        cu_seqlens=tensor(cu_seqlens, torch.int32),
        cu_seqlens_list=cu_seqlens,
        past_lens=[seg.past_len for seg in segments],
        max_seqlen=max(len(seg.token_ids) for seg in segments),
        logits_indices=tensor(logits_indices),
        logits_rows=logits_rows,
        request_ids=[seg.request_id for seg in segments],
        adapters=[seg.adapter for seg in segments],
        block_tables=[list(seg.block_ids) for seg in segments],
        slot_blocks=tensor(slot_blocks) if pool is not None else None,
        slot_offsets=tensor(slot_offsets) if pool is not None else None,
        attention=backend.plan(segments, cu_seqlens, device) if pool is not None else None,
        prompt_rows=[seg.prompt_rows for seg in segments],
        prompt=tensor(prompt, torch.bool) if any(prompt) else None,
    )


def padded_block_table(
    segments: Sequence[Segment], lengths: list[int], block_size: int, device: torch.device | str
) -> torch.Tensor:
    """[S, max_blocks] int32: the blocks covering each segment's `lengths` tokens, zero-padded
    (the paged CUDA kernels' block_table and the CPU decode kernel's tables; all read only `lengths`)."""
    tables = [seg.block_ids[: blocks_for(n, block_size)] for seg, n in zip(segments, lengths)]
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
