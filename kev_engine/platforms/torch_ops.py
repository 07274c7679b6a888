"""torch's own ops: the reference attention every other backend is tested against, and the
platform of a device without one of its own (`TorchPlatform`).

Pool layout: keys and values [num_blocks, kv_heads, block_size, head_dim], so one block of one
head is a contiguous [block_size, head_dim] matrix that a batched matmul reads in place.

Prefill chunks take one SDPA call each (ΣLᵢ² work, large calls): a fresh prompt over its own new
keys, a chunk continuing a cached prefix over its blocks gathered once per layer. All decode rows
take ONE computation per layer, however many rows there are (`batched_decode`): a fixed set of
torch kernels per block group (`decode_layout`: dense ranges of the pool read in place, the
scattered rest gathered; a shared prefix block read once for all its rows, cascade-style).

Unbound (no pool: a pack built without an engine, in tests and drawings), it attends each
segment over its new keys only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.blocks import blocks_for
from ..model.pack import PackedBatch, Segment, padded_block_table
from . import inplace
from .base import AttentionBackend, Platform

GROUP_COST_BLOCKS = 24  # a block group's fixed kernels per layer cost about as much as reading this many blocks
GATHER_COST = 3  # a gathered block is read, copied and read again: 3 block reads against 1 in place


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
    tables: torch.Tensor | None = None  # the compiled kernel's: [B, max_blocks] int32 block ids, zero-padded
    lengths: torch.Tensor | None = None  # the compiled kernel's: [B] int32 tokens each row reads (its own included)


class TorchBackend(AttentionBackend):
    """Prefill per segment by SDPA, decode rows in one batched computation per layer."""

    name: ClassVar[str] = "torch"

    def plan(self, segments: Sequence[Segment], cu_seqlens: list[int], device: torch.device | str) -> Any:
        return decode_layout(segments, cu_seqlens, self.pool.block_size, device)

    def write(self, layer: int, batch: PackedBatch, key: torch.Tensor, value: torch.Tensor) -> None:
        self.pool.check_new(key)
        self.pool.keys[layer][batch.slot_blocks, :, batch.slot_offsets] = key.transpose(0, 1)
        self.pool.values[layer][batch.slot_blocks, :, batch.slot_offsets] = value.transpose(0, 1)

    def attend(self, layer: int, batch: PackedBatch, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None) -> torch.Tensor:
        decode: DecodeLayout | None = batch.attention
        if decode is not None and len(decode.row_segments) == batch.num_segments:  # rows alone: no gather/scatter
            return self.decode_rows(query.transpose(0, 1), decode, layer, scaling)
        skip = set() if decode is None else set(decode.row_segments)
        out = self._per_segment(batch, layer, query, key, value, scaling, skip)
        if decode is not None:
            rows = query[:, decode.row_tokens].transpose(0, 1)  # [B, H, D]
            out[decode.row_tokens] = self.decode_rows(rows, decode, layer, scaling)
        return out

    def decode_rows(self, rows: torch.Tensor, decode: DecodeLayout, layer: int, scaling: float | None) -> torch.Tensor:
        """All decode rows of one layer in one computation: rows [B, H, D] → [B, H, D]."""
        return batched_decode(rows, decode, self.pool.keys[layer], self.pool.values[layer], scaling)

    def gather(self, layer: int, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One question's keys/values over its blocks, positions 0..length: [num_kv_heads, length, head_dim]."""
        keys = self.pool.keys[layer][block_ids]  # [n, kvH, bs, D]
        values = self.pool.values[layer][block_ids]
        n, kv_heads, block_size, head_dim = keys.shape
        flat_k = keys.transpose(0, 1).reshape(kv_heads, n * block_size, head_dim)
        flat_v = values.transpose(0, 1).reshape(kv_heads, n * block_size, head_dim)
        return flat_k[:, :length], flat_v[:, :length]

    def _segment_keys(self, batch: PackedBatch, i: int, layer: int, key: torch.Tensor, value: torch.Tensor):
        """Keys/values segment i attends to: its new ones alone, or its cached prefix and them."""
        cu = batch.cu_seqlens_list
        past, n = batch.past_lens[i], cu[i + 1] - cu[i]
        if past == 0:
            return key[:, cu[i] : cu[i + 1]], value[:, cu[i] : cu[i + 1]]
        blocks = torch.tensor(batch.block_tables[i][: blocks_for(past + n, self.pool.block_size)], device=key.device)
        return self.gather(layer, blocks, past + n)  # a copy, once per prefill chunk and layer

    def _per_segment(self, batch: PackedBatch, layer: int, query, key, value, scaling, skip: set[int]) -> torch.Tensor:
        # query [H, T, D]; key/value [kvH, T, D] → out [T, H, D] (rows of `skip` segments left unset)
        cu = batch.cu_seqlens_list
        out = query.new_empty(query.shape[1], query.shape[0], query.shape[2])
        for i in range(batch.num_segments):
            if i in skip:
                continue
            seg_k, seg_v = self._segment_keys(batch, i, layer, key, value)
            seg_out = segment_attention(query[:, cu[i] : cu[i + 1]], seg_k, seg_v, batch.past_lens[i], scaling)
            out[cu[i] : cu[i + 1]] = seg_out.transpose(0, 1)
        return out


def one_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """One query token over its keys: query [H, 1, D], key/value [kvH, L, D] → [H, 1, D].

    Only for a one-token segment of a pack without a KV pool (a one-token prompt in a test or
    drawing); the engine's decode rows all go through `decode_rows`. Two small bmm calls with
    the query heads grouped per kv head (GQA without repeating keys): CPU SDPA spends far longer
    on setup than on math for a single query.
    """
    num_heads, _, head_dim = query.shape
    num_kv_heads = key.shape[0]
    scale = scaling if scaling is not None else head_dim**-0.5
    q = query.reshape(num_kv_heads, num_heads // num_kv_heads, head_dim)  # [kvH, G, D]
    scores = torch.bmm(q, key.transpose(1, 2)).float() * scale  # [kvH, G, L], softmax in fp32
    out = torch.bmm(scores.softmax(dim=-1).to(value.dtype), value)  # [kvH, G, D]
    return out.reshape(num_heads, 1, head_dim)


def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past_len: int, scaling: float | None
) -> torch.Tensor:
    """query [H, n, D] over key/value [kvH, past_len + n, D] → [H, n, D], causal, bottom-right aligned."""
    n = query.shape[1]
    if n == 1:
        return one_query_attention(query, key, value, scaling)
    mask = None
    is_causal = False
    if past_len == 0:
        is_causal = True
    else:  # a chunk joining its own cached prefix: query i sees keys 0..past_len+i
        mask = torch.ones(n, past_len + n, dtype=torch.bool, device=query.device).tril(diagonal=past_len)
    out = F.scaled_dot_product_attention(
        query[None], key[None], value[None], attn_mask=mask, is_causal=is_causal, scale=scaling,
        enable_gqa=query.shape[0] != key.shape[0],
    )
    return out[0]


def batched_decode(
    query: torch.Tensor, layout: DecodeLayout, keys: torch.Tensor, values: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Every decode row over its own KV blocks at once: query [B, H, D] → [B, H, D].

    keys/values: one layer of the pool, [num_blocks, kvH, block_size, D]. Each block is scored
    against the query of the row(s) that read it — a batched matmul over blocks, reading the pool
    in place — then a softmax segmented by row (row max, exp, row sum via scatter/index_add) and
    one more batched matmul for the values. A shared prefix block is read once for all its rows
    (its group has M rows per block). A fixed number of kernels per group and layer, whatever B
    is; a range viewed in place may hold blocks no row here reads (holes): they go to the
    "nobody" row B, whose result is dropped, so stale memory there never reaches an answer.
    """
    num_rows, num_heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    group = num_heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    q = torch.cat([query * scale, query.new_zeros(1, num_heads, head_dim)])  # the scale folded into B queries
    q = q.view(num_rows + 1, kv_heads, group, head_dim)
    row_max = query.new_full((num_rows + 1, kv_heads, group), float("-inf"), dtype=torch.float32)
    scored = []
    for g in layout.groups:  # index_select, not advanced indexing: far less per-call overhead on CPU
        if g.block_ids is None:
            k, v = keys[g.start : g.stop], values[g.start : g.stop]  # views: no copy
        else:
            k, v = keys.index_select(0, g.block_ids), values.index_select(0, g.block_ids)
        nb, width = g.owners.shape
        qg = q.index_select(0, g.owner_ids).view(nb, width, kv_heads, group, head_dim).transpose(1, 2)
        qg = qg.reshape(nb, kv_heads, width * group, head_dim)  # [nb, kvH, M*G, D]
        s = torch.matmul(qg, k.transpose(-1, -2)).float()  # [nb, kvH, M*G, bs]
        s.add_(g.bias[:, None, None, :])  # positions the row does not own: -inf
        block_max = s.amax(dim=-1).view(nb, kv_heads, width, group).transpose(1, 2)
        block_max = block_max.reshape(nb * width, kv_heads, group)  # [nb*M, kvH, G]: one entry per (block, reader)
        index = g.owner_ids[:, None, None].expand(-1, kv_heads, group)
        row_max.scatter_reduce_(0, index, block_max, reduce="amax")
        scored.append((g, s, v))
    row_max = torch.nan_to_num(row_max, neginf=0.0)  # the "nobody" row may see no key at all
    out = torch.zeros(num_rows + 1, kv_heads, group, head_dim, dtype=torch.float32, device=query.device)
    total = torch.zeros(num_rows + 1, kv_heads, group, dtype=torch.float32, device=query.device)
    for g, s, v in scored:
        nb, width = g.owners.shape
        shift = row_max.index_select(0, g.owner_ids).view(nb, width, kv_heads, group).transpose(1, 2)
        p = s.sub_(shift.reshape(nb, kv_heads, width * group)[..., None]).exp_()  # [nb, kvH, M*G, bs], in place
        sums = p.sum(dim=-1).view(nb, kv_heads, width, group).transpose(1, 2).reshape(nb * width, kv_heads, group)
        total.index_add_(0, g.owner_ids, sums)
        pv = torch.matmul(p.to(v.dtype), v).float()  # [nb, kvH, M*G, D]
        pv = pv.view(nb, kv_heads, width, group, head_dim).transpose(1, 2)
        pv = pv.reshape(nb * width, kv_heads, group, head_dim)
        out.index_add_(0, g.owner_ids, pv)
    out = out[:num_rows] / total[:num_rows, ..., None]
    return out.reshape(num_rows, num_heads, head_dim).to(query.dtype)


def decode_rows_of(segments: Sequence[Segment], cu_seqlens: list[int], device: torch.device | str):
    """The one-token segments: (their indices, the flat index of each one's token, the tokens each reads)."""
    rows = [i for i, seg in enumerate(segments) if len(seg.token_ids) == 1]
    row_tokens = torch.tensor([cu_seqlens[i] for i in rows], dtype=torch.long, device=device)
    return rows, row_tokens, [segments[i].past_len + 1 for i in rows]


def decode_layout(
    segments: Sequence[Segment], cu_seqlens: list[int], block_size: int, device: torch.device | str,
) -> DecodeLayout | None:
    """The one-token segments' blocks, grouped: blocks one row reads (its own suffix) and blocks
    several rows read (a shared prefix: read once for all of them)."""
    rows, row_tokens, lengths = decode_rows_of(segments, cu_seqlens, device)
    if not rows:
        return None
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


def kernel_decode_layout(
    segments: Sequence[Segment], cu_seqlens: list[int], block_size: int, device: torch.device | str,
) -> DecodeLayout | None:
    """The one-token segments as the compiled kernel reads them: a padded block table and a length per row."""
    rows, row_tokens, lengths = decode_rows_of(segments, cu_seqlens, device)
    if not rows:
        return None
    tables = padded_block_table([segments[i] for i in rows], lengths, block_size, device)
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device=device)
    return DecodeLayout(row_tokens, rows, tables=tables, lengths=lengths_t)


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


class TorchPlatform(Platform):
    """Any device without a platform of its own (MPS, XPU...): torch's ops, the reference attention
    above, elementwise work in place; not batch-invariant."""

    def __init__(self, device: torch.device, batch_invariant: bool) -> None:
        super().__init__(device, TorchBackend(), batch_invariant)
        self.name = device.type

    def install(self, model: nn.Module) -> list[str]:
        inplace.install(model)
        return []
