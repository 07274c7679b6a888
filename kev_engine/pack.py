"""Pack: the scheduled chunks of many questions → one flat sequence the model runs at once.

Each segment is one question's new tokens this pass; `position_ids` continue that question's
own count (restarting at 0 for a fresh prompt), `cu_seqlens` marks where segments start and
end, `past_lens` says how much of each question is already in KV blocks, and the slot mapping
says where each new token's keys/values go. Decode rows (one new token) also get a
`DecodeLayout`: padded block tables for the compiled CPU kernel, or their blocks grouped for
the torch path, so that ONE attention computation per layer serves them all, whatever their
number. Plain Python list-building, then one host→device copy per tensor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .blocks import blocks_for

GROUP_COST_BLOCKS = 24  # a block group's fixed kernels per layer cost about as much as reading this many blocks
GATHER_COST = 3  # a gathered block is read, copied and read again: 3 block reads against 1 in place


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


@dataclass
class BlockGroup:
    """Blocks several decode rows read, each block on behalf of up to M rows.

    Either a range of the pool viewed in place (`start`, `stop`) or gathered `block_ids`.
    """

    owners: torch.Tensor  # [nb, M] long: decode row per (block, reader); B = nobody
    owner_ids: torch.Tensor  # [nb * M] long: the same, flat
    bias: torch.Tensor  # [nb, block_size] fp32: 0 where the block holds the row's tokens, -inf elsewhere
    start: int = 0
    stop: int = 0
    block_ids: torch.Tensor | None = None  # [nb] long, when gathered


@dataclass
class DecodeLayout:
    """The decode rows of a pass and their KV blocks, prepared once for every layer."""

    row_tokens: torch.Tensor  # [B] long: flat index of each decode row's token
    row_segments: list[int]  # [B] the segment each row is
    groups: list[BlockGroup] = field(default_factory=list)  # the torch path's block groups
    tables: torch.Tensor | None = None  # the kernel's: [B, max_blocks] int32 block ids, zero-padded
    lengths: torch.Tensor | None = None  # the kernel's: [B] int32 tokens each row reads (its own included)


@dataclass
class PagedTables:
    """What a paged varlen kernel (torch's `varlen_attn`, flash-attn) reads besides the pool.

    Segment i's keys are its first `seqused_k[i]` positions, read through `block_table[i]`; its
    new tokens are the last ones of them, so the causal mask is bottom-right aligned. A CUDA graph
    fills static tensors of the same shape (`backends.cuda_graphs`), with `max_seqlen_k` the
    longest context any row can reach: the kernel only uses it as an upper bound.
    """

    cu_seqlens_k: torch.Tensor  # [S+1] int32: cumulative seqused_k
    max_seqlen_k: int  # longest seqused_k this pass (or an upper bound of it)
    block_table: torch.Tensor  # [S, max_blocks] int32, zero-padded
    seqused_k: torch.Tensor  # [S] int32: tokens each segment attends to, its new ones included


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
    kv: Any = None  # the engine's KVPool; None = prefill-only pack with no memory (tests, drawings)
    slot_blocks: torch.Tensor | None = None  # [T] long: block of each new token's K/V
    slot_offsets: torch.Tensor | None = None  # [T] long: its position inside that block
    decode: DecodeLayout | None = None  # CPU pool: decode rows, attended in one batched call per layer
    exact: tuple[torch.Tensor, torch.Tensor] | None = None  # exact pool: (block tables [S, max_blocks], past [S]) int32
    paged: PagedTables | None = None  # CUDA pool ([blocks, block_size, kvH, D]): the paged kernels' tables

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_list[-1]

    @property
    def num_segments(self) -> int:
        return len(self.request_ids)

    def segment_lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.cu_seqlens_list, self.cu_seqlens_list[1:])]


def pack(segments: Sequence[Segment], device: torch.device | str = "cpu", kv: Any = None) -> PackedBatch:
    """Concatenate the segments; logits are kept only where a segment needs them."""
    if not segments:
        raise ValueError("pack() needs at least one segment")
    input_ids: list[int] = []
    position_ids: list[int] = []
    cu_seqlens = [0]
    logits_indices: list[int] = []
    logits_rows: list[tuple[int, int]] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    block_size = kv.block_size if kv is not None else 0
    for seg in segments:
        assert seg.token_ids, f"empty segment for request {seg.request_id}"
        start = len(input_ids)
        input_ids.extend(seg.token_ids)
        positions = range(seg.past_len, seg.past_len + len(seg.token_ids))
        position_ids.extend(positions)
        cu_seqlens.append(len(input_ids))
        first = len(logits_indices)
        if seg.all_logits:
            logits_indices.extend(range(start, len(input_ids)))
        elif seg.needs_logits:
            logits_indices.append(len(input_ids) - 1)
        logits_rows.append((first, len(logits_indices)))
        if kv is not None:
            assert len(seg.block_ids) * block_size >= positions.stop, f"request {seg.request_id} lacks KV blocks"
            slot_blocks.extend(seg.block_ids[p // block_size] for p in positions)
            slot_offsets.extend(p % block_size for p in positions)
    if kv is None and any(seg.past_len for seg in segments):
        raise ValueError("a segment continues cached tokens, so the pack needs the engine's KV pool")

    paged = kv is not None
    exact = getattr(kv, "exact", None) if paged else None  # the pool serves the batch-invariant attention

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
        kv=kv,
        slot_blocks=tensor(slot_blocks) if kv is not None else None,
        slot_offsets=tensor(slot_offsets) if kv is not None else None,
        decode=(decode_layout(segments, cu_seqlens, block_size, device, kernel=kv.paged_decode is not None)
                if paged and not kv.flash_layout and exact is None else None),
        paged=paged_tables(segments, block_size, device) if paged and kv.flash_layout else None,
        exact=exact_tables(segments, block_size, device) if exact is not None else None,
    )


def exact_tables(segments: Sequence[Segment], block_size: int, device: torch.device | str):
    """The exact attention's arguments: every segment's block table [S, max_blocks] and past length [S], int32."""
    lengths = [seg.past_len + len(seg.token_ids) for seg in segments]
    past = torch.tensor([seg.past_len for seg in segments], dtype=torch.int32, device=device)
    return padded_block_table(segments, lengths, block_size, device), past


def paged_tables(segments: Sequence[Segment], block_size: int, device: torch.device | str) -> PagedTables:
    """The paged kernels' arguments for these segments (see `PagedTables`)."""
    lengths = [seg.past_len + len(seg.token_ids) for seg in segments]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return PagedTables(
        cu_seqlens_k=torch.tensor(cu, dtype=torch.int32, device=device),
        max_seqlen_k=max(lengths),
        block_table=padded_block_table(segments, lengths, block_size, device),
        seqused_k=torch.tensor(lengths, dtype=torch.int32, device=device),
    )


def padded_block_table(
    segments: Sequence[Segment], lengths: list[int], block_size: int, device: torch.device | str
) -> torch.Tensor:
    """[S, max_blocks] int32: the blocks covering each segment's `lengths` tokens, zero-padded
    (the paged CUDA kernels' block_table and the CPU decode kernel's tables; all read only `lengths`)."""
    tables = [seg.block_ids[: blocks_for(n, block_size)] for seg, n in zip(segments, lengths)]
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)


def decode_layout(
    segments: Sequence[Segment], cu_seqlens: list[int], block_size: int, device: torch.device | str,
    kernel: bool = False,
) -> DecodeLayout | None:
    """The one-token segments' blocks: a padded block table per row for the compiled kernel
    (`kernel`), else grouped for the torch path — blocks one row reads (its own suffix) and blocks
    several rows read (a shared prefix: read once for all of them, cascade-style)."""
    rows = [i for i, seg in enumerate(segments) if len(seg.token_ids) == 1]
    if not rows:
        return None
    row_tokens = torch.tensor([cu_seqlens[i] for i in rows], dtype=torch.long, device=device)
    lengths = [segments[i].past_len + 1 for i in rows]
    if kernel:
        tables = padded_block_table([segments[i] for i in rows], lengths, block_size, device)
        return DecodeLayout(row_tokens, rows, tables=tables,
                            lengths=torch.tensor(lengths, dtype=torch.int32, device=device))
    num_rows = len(rows)
    readers: dict[int, list[tuple[int, int]]] = defaultdict(list)  # block → [(row, valid tokens)]
    for row, (i, length) in enumerate(zip(rows, lengths)):
        for j, block_id in enumerate(segments[i].block_ids[: blocks_for(length, block_size)]):
            readers[block_id].append((row, min(block_size, length - j * block_size)))
    groups: list[BlockGroup] = []
    for shared in (False, True):  # private blocks (one reader) and shared ones: different widths
        part = {b: r for b, r in readers.items() if (len(r) > 1) == shared}
        ranges, scattered = _clusters(sorted(part))
        groups.extend(_group(part, range(lo, hi), num_rows, block_size, device, True) for lo, hi in ranges)
        if scattered:
            groups.append(_group(part, scattered, num_rows, block_size, device, False))
    return DecodeLayout(row_tokens, rows, groups)


def _clusters(ids: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Split sorted block ids into ranges read in place and the scattered rest, to be gathered.

    Cost in block reads per layer: a range reads its whole span, holes included, plus a group's
    fixed kernels; a gathered block is read, copied and read again. Blocks of long-running engines
    are fragmented (cached prefixes and freed tails sit between a pass's blocks), so one range over
    everything, or one gather of everything, can each cost far more than this split.
    """
    ranges: list[tuple[int, int]] = []
    scattered: list[int] = []
    start = 0
    for k in range(1, len(ids) + 1):
        if k < len(ids) and ids[k] - ids[k - 1] <= GROUP_COST_BLOCKS:
            continue
        run = ids[start:k]
        if run[-1] - run[0] + 1 + GROUP_COST_BLOCKS <= GATHER_COST * len(run):
            ranges.append((run[0], run[-1] + 1))
        else:
            scattered.extend(run)
        start = k
    return ranges, scattered


def _group(
    readers: dict[int, list[tuple[int, int]]], ids: Sequence[int], num_rows: int, block_size: int,
    device: torch.device | str, in_place: bool,
) -> BlockGroup:
    """One BlockGroup over `ids`: a range of the pool viewed in place (blocks nobody here reads are
    masked out), or gathered blocks. Each block has up to M readers, its `owners`."""
    width = max(len(readers.get(b, ())) for b in ids)
    owners = [[num_rows] * width for _ in ids]
    counts = [0] * len(ids)
    for k, block_id in enumerate(ids):
        for m, (row, num_valid) in enumerate(readers.get(block_id, [])):
            owners[k][m] = row
            counts[k] = num_valid  # a shared block is a full one: the same count for each reader
    count_t = torch.tensor(counts, dtype=torch.long, device=device)
    valid = torch.arange(block_size, device=device)[None, :] < count_t[:, None]  # [nb, bs]
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_fill_(~valid, float("-inf"))
    owners_t = torch.tensor(owners, dtype=torch.long, device=device)
    if in_place:
        return BlockGroup(owners_t, owners_t.flatten(), bias, start=ids[0], stop=ids[-1] + 1)
    block_ids = torch.tensor(list(ids), dtype=torch.long, device=device)
    return BlockGroup(owners_t, owners_t.flatten(), bias, block_ids=block_ids)
