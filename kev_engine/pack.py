"""Pack: the scheduled chunks of many questions → one flat sequence the model runs at once.

Each segment is one question's new tokens this pass; `position_ids` continue that question's
own count (restarting at 0 for a fresh prompt), `cu_seqlens` marks where segments start and
end, and `past_lens` says how much of each question is already in its KV cache. Plain
Python list-building, then one host→device copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .kv_cache import SequenceKV


@dataclass
class Segment:
    """One question's share of a pass: `token_ids` follow `past_len` cached tokens."""

    request_id: int
    token_ids: list[int]
    past_len: int
    needs_logits: bool
    cache: SequenceKV | None = None
    adapter: str | None = None


@dataclass
class PackedBatch:
    """What one forward pass sees. T = total new tokens, S = segments."""

    input_ids: torch.Tensor  # [T] long
    position_ids: torch.Tensor  # [T] long, restarting per question
    cu_seqlens: torch.Tensor  # [S+1] int32, segment boundaries in the flat sequence
    cu_seqlens_list: list[int]  # the same on the host, to slice without a device sync
    past_lens: list[int]  # [S] tokens already cached per segment
    max_seqlen: int  # longest segment this pass (flash-attn's max_seqlen_q)
    logits_indices: torch.Tensor  # [K] flat index of each last token that needs logits
    request_ids: list[int]  # [S]
    adapters: list[str | None]  # [S]
    caches: list[SequenceKV | None] = field(default_factory=list)  # [S]

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_list[-1]

    @property
    def num_segments(self) -> int:
        return len(self.request_ids)

    def segment_lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.cu_seqlens_list, self.cu_seqlens_list[1:])]


def pack(segments: Sequence[Segment], device: torch.device | str = "cpu") -> PackedBatch:
    """Concatenate the segments; logits are kept only at the last token of those that need them."""
    if not segments:
        raise ValueError("pack() needs at least one segment")
    input_ids: list[int] = []
    position_ids: list[int] = []
    cu_seqlens = [0]
    logits_indices: list[int] = []
    for seg in segments:
        assert seg.token_ids, f"empty segment for request {seg.request_id}"
        input_ids.extend(seg.token_ids)
        position_ids.extend(range(seg.past_len, seg.past_len + len(seg.token_ids)))
        cu_seqlens.append(len(input_ids))
        if seg.needs_logits:
            logits_indices.append(len(input_ids) - 1)
    return PackedBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        position_ids=torch.tensor(position_ids, dtype=torch.long, device=device),
        cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
        cu_seqlens_list=cu_seqlens,
        past_lens=[seg.past_len for seg in segments],
        max_seqlen=max(len(seg.token_ids) for seg in segments),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        request_ids=[seg.request_id for seg in segments],
        adapters=[seg.adapter for seg in segments],
        caches=[seg.cache for seg in segments],
    )
