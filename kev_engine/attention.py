"""Forward's attention: block-diagonal causal attention over a pack, never a dense T×T mask.

Registered with transformers' `AttentionInterface` under `KEV_ATTENTION`, together with a
mask function that returns None — so transformers never builds a (leaky or O(T²)) mask and
never falls back to its automatic packed-sequence detection, which is skipped whenever a
cache exists. The pack travels in the forward kwargs as `kev_pack` (a `PackedBatch`).

Each segment attends only to its own question: new keys/values go into that question's
`SequenceKV`, queries see that question's cached prefix plus its own new tokens, causally.
CPU (and CUDA without flash-attn): one SDPA call per segment, ΣLᵢ² work in total.
CUDA with flash-attn: one `flash_attn_varlen_func` call over the pack with `cu_seqlens`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .pack import PackedBatch

KEV_ATTENTION = "kev_varlen"

try:  # optional CUDA kernel
    from flash_attn import flash_attn_varlen_func as _flash_attn_varlen_func
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _flash_attn_varlen_func = None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function for KEV_ATTENTION: segment structure comes from the pack, not a mask."""
    return None


def _decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """One new token over its own cache: query [H, 1, D], key/value [kvH, L, D] → [H, 1, D].

    Two small bmm calls with the query heads grouped per kv head (GQA without repeating
    keys). CPU SDPA kernels spend far longer on setup than on math for a single query
    (about 130 µs per call in bf16 here), and decode makes one call per question per layer.
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


def _write_caches(batch: PackedBatch, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Append each segment's new keys/values ([kvH, T, D] flat) to its own cache."""
    cu = batch.cu_seqlens_list
    for i, cache in enumerate(batch.caches):
        if cache is not None:
            cache.write(layer, batch.past_lens[i], key[:, cu[i] : cu[i + 1]], value[:, cu[i] : cu[i + 1]])


def _keys_for(batch: PackedBatch, i: int, layer: int, key: torch.Tensor, value: torch.Tensor):
    """Keys/values segment i attends to: its new ones alone, or its whole cached prefix."""
    cu = batch.cu_seqlens_list
    if batch.past_lens[i] == 0:
        return key[:, cu[i] : cu[i + 1]], value[:, cu[i] : cu[i + 1]]
    cache = batch.caches[i]
    assert cache is not None, "a segment with a cached prefix needs its cache"
    return cache.read(layer, batch.past_lens[i] + cu[i + 1] - cu[i])


def _per_segment(batch: PackedBatch, layer: int, query, key, value, scaling) -> torch.Tensor:
    # query [H, T, D]; key/value [kvH, T, D] → out [T, H, D]
    cu = batch.cu_seqlens_list
    out = query.new_empty(query.shape[1], query.shape[0], query.shape[2])
    for i in range(batch.num_segments):
        seg_k, seg_v = _keys_for(batch, i, layer, key, value)
        seg_out = _segment_attention(query[:, cu[i] : cu[i + 1]], seg_k, seg_v, batch.past_lens[i], scaling)
        out[cu[i] : cu[i + 1]] = seg_out.transpose(0, 1)
    return out


def _flash_varlen(batch: PackedBatch, layer: int, query, key, value, scaling) -> torch.Tensor:
    # flash-attn wants [T, H, D]; its causal mask is bottom-right aligned, as a chunk with a prefix needs
    q = query.transpose(0, 1)
    if not any(batch.past_lens):
        k, v = key.transpose(0, 1), value.transpose(0, 1)
        cu_k, max_k = batch.cu_seqlens, batch.max_seqlen
    else:
        pairs = [_keys_for(batch, i, layer, key, value) for i in range(batch.num_segments)]
        k = torch.cat([p[0].transpose(0, 1) for p in pairs])
        v = torch.cat([p[1].transpose(0, 1) for p in pairs])
        lens = [p[0].shape[1] for p in pairs]
        cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
        max_k = max(lens)
    return _flash_attn_varlen_func(
        q, k, v, batch.cu_seqlens, cu_k, batch.max_seqlen, max_k, softmax_scale=scaling, causal=True
    )


def use_flash(query: torch.Tensor) -> bool:
    return _flash_attn_varlen_func is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


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
    _write_caches(batch, layer, k, v)
    if use_flash(q):
        out = _flash_varlen(batch, layer, q, k, v, scaling)
    else:
        out = _per_segment(batch, layer, q, k, v, scaling)
    return out[None], None


def register() -> None:
    """Make KEV_ATTENTION known to transformers (idempotent)."""
    AttentionInterface.register(KEV_ATTENTION, kev_attention)
    AttentionMaskInterface.register(KEV_ATTENTION, _no_mask)


register()
