"""Forward's attention: block-diagonal causal attention over a pack, never a dense T×T mask.

Registered with transformers' `AttentionInterface` under `KEV_ATTENTION`, together with a
mask function that returns None — so transformers never builds a (leaky or O(T²)) mask and
never falls back to its automatic packed-sequence detection, which is skipped whenever a
cache exists. The pack travels in the forward kwargs as `kev_pack` (a `PackedBatch`).

Each segment attends only to its own question: every new token's keys/values are written to
its slot in the engine's KV pool first (so a question starting after a prefix that an earlier
segment of the same pass computes reads it, layer by layer), then queries see that question's
blocks — its own, or a shared prefix's — plus its own new tokens, causally.
CPU (and CUDA without a paged kernel): prefill chunks take one SDPA call each (ΣLᵢ² work, large
calls); all decode rows take ONE computation per layer, however many rows there are: on CPU the
compiled kernel (`decode_kernel`, one call over every row's block table), else `batched_decode`,
a fixed set of torch kernels per block group (`pack.decode_layout`: dense ranges of the pool read
in place, the scattered rest gathered).
CUDA (`backends.cuda`): one paged kernel call per layer over the whole pack — torch's own
`varlen_attn` (or the optional flash-attn) with `cu_seqlens`, the block table and `seqused_k`:
nothing is concatenated or copied per step.
Batch-invariant (an "exact" pool, CPU): every row of the pack, prefill and decode alike, in ONE
call of Kev's `paged_attention` per layer, each row walking its own positions in one fixed order
(csrc/attention.cpp) — so its result is the same shared, cached, chunked or alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .blocks import blocks_for
from .pack import DecodeLayout, PackedBatch

KEV_ATTENTION = "kev_varlen"


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function for KEV_ATTENTION: segment structure comes from the pack, not a mask."""
    return None


def _decode_attention(
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


def _segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past_len: int, scaling: float | None
) -> torch.Tensor:
    """query [H, n, D] over key/value [kvH, past_len + n, D] → [H, n, D], causal, bottom-right aligned."""
    n = query.shape[1]
    if n == 1:
        return _decode_attention(query, key, value, scaling)
    mask = None
    is_causal = False
    if n > 1 and past_len == 0:
        is_causal = True
    elif n > 1:  # a chunk joining its own cached prefix: query i sees keys 0..past_len+i
        mask = torch.ones(n, past_len + n, dtype=torch.bool, device=query.device).tril(diagonal=past_len)
    out = F.scaled_dot_product_attention(
        query[None], key[None], value[None], attn_mask=mask, is_causal=is_causal, scale=scaling,
        enable_gqa=query.shape[0] != key.shape[0],
    )
    return out[0]


def _segment_keys(batch: PackedBatch, i: int, layer: int, key: torch.Tensor, value: torch.Tensor):
    """Keys/values segment i attends to: its new ones alone, or its cached prefix and them."""
    cu = batch.cu_seqlens_list
    past, n = batch.past_lens[i], cu[i + 1] - cu[i]
    if past == 0:
        return key[:, cu[i] : cu[i + 1]], value[:, cu[i] : cu[i + 1]]
    blocks = torch.tensor(batch.block_tables[i][: blocks_for(past + n, batch.kv.block_size)], device=key.device)
    return batch.kv.gather(layer, blocks, past + n)  # a copy, once per prefill chunk and layer


def _per_segment(batch: PackedBatch, layer: int, query, key, value, scaling, skip: set[int]) -> torch.Tensor:
    # query [H, T, D]; key/value [kvH, T, D] → out [T, H, D] (rows of `skip` segments left unset)
    cu = batch.cu_seqlens_list
    out = query.new_empty(query.shape[1], query.shape[0], query.shape[2])
    for i in range(batch.num_segments):
        if i in skip:
            continue
        seg_k, seg_v = _segment_keys(batch, i, layer, key, value)
        seg_out = _segment_attention(query[:, cu[i] : cu[i + 1]], seg_k, seg_v, batch.past_lens[i], scaling)
        out[cu[i] : cu[i + 1]] = seg_out.transpose(0, 1)
    return out


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


def _exact_paged(batch: PackedBatch, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Every segment, prefill and decode, in ONE call of the batch-invariant kernel: query [H, T, D] → [T, H, D]."""
    assert batch.exact is not None
    tables, past = batch.exact
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kv = batch.kv
    return kv.exact.paged_attention(query.transpose(0, 1).contiguous(), kv.keys[layer], kv.values[layer], tables,
                                    batch.cu_seqlens, past, scale)


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
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError("Kev's packed attention supports neither sliding windows nor soft-capping yet")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    q, k, v = query[0], key[0], value[0]
    kv = batch.kv
    if kv is not None:  # every segment's new keys go in first: later segments may read them this pass
        kv.write(layer, batch.slot_blocks, batch.slot_offsets, k, v)
        if kv.flash_layout:  # the CUDA pool: its paged kernel (backends.cuda)
            return kv.paged_attention(batch, layer, q, scaling)[None], None
        if kv.exact is not None:
            return _exact_paged(batch, layer, q, scaling)[None], None
    decode = batch.decode
    if decode is not None and len(decode.row_segments) == batch.num_segments:  # rows alone: no gather/scatter
        return decode_rows(q.transpose(0, 1), decode, kv, layer, scaling)[None], None
    skip = set() if decode is None else set(decode.row_segments)
    out = _per_segment(batch, layer, q, k, v, scaling, skip)
    if decode is not None:
        rows = q[:, decode.row_tokens].transpose(0, 1)  # [B, H, D]
        out[decode.row_tokens] = decode_rows(rows, decode, kv, layer, scaling)
    return out[None], None


def decode_rows(rows: torch.Tensor, decode: DecodeLayout, kv: Any, layer: int, scaling: float | None) -> torch.Tensor:
    """All decode rows of one layer in one call: the compiled kernel when the pool has it."""
    if decode.tables is None:
        return batched_decode(rows, decode, kv.keys[layer], kv.values[layer], scaling)
    assert decode.lengths is not None and kv.paged_decode is not None
    scale = scaling if scaling is not None else rows.shape[-1] ** -0.5
    return kv.paged_decode(rows, kv.keys[layer], kv.values[layer], decode.tables, decode.lengths, scale)


def register() -> None:
    """Make KEV_ATTENTION known to transformers (idempotent)."""
    AttentionInterface.register(KEV_ATTENTION, kev_attention)
    AttentionMaskInterface.register(KEV_ATTENTION, _no_mask)


register()
