"""A stand-in for torch's `varlen_attn` in its paged form, in plain torch, for CPU tests.

It follows the function's documented contract (torch 2.12+ docstring), and checks that Kev
calls it that way: query [T_q, H_q, D]; key/value the pool of pages [pages, page_size, H_kv, D];
`block_table` [N, max_pages] int32 with a contiguous last dimension, required with `seqused_k`
[N] int32; `cu_seq_q` [N+1] int32; `window_size=(-1, 0)` is causal, aligned bottom-right (query i
of a segment's n new tokens sees its first seqused_k - n + i + 1 keys); `enable_gqa` when H_q !=
H_kv; `max_q`/`max_k` are upper bounds of the lengths; `num_splits` is recorded, not simulated.
Only the first `seqused_k[i]` tokens of a sequence's pages are read, so stale memory elsewhere
in the pool (NaN, in these tests) reaches no result unless Kev points the kernel at it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class VarlenContract:
    """Callable like `varlen_attn`; `calls` keeps each call's num_splits, bounds, segments and new tokens."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        assert return_aux is None
        assert block_table is not None and seqused_k is not None, "Kev's CUDA path is the paged form"
        assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
        assert seqused_k.dtype == torch.int32 and cu_seq_q.dtype == torch.int32 and cu_seq_k.dtype == torch.int32
        assert tuple(window_size) == (-1, 0), "causal"
        assert query.dim() == 3 and key.dim() == 4 and key.shape == value.shape
        num_heads, kv_heads = query.shape[1], key.shape[2]
        assert enable_gqa == (num_heads != kv_heads) and num_heads % kv_heads == 0
        segments = len(cu_seq_q) - 1
        assert block_table.shape[0] == segments and seqused_k.shape == (segments,) and cu_seq_k.shape == (segments + 1,)
        page = key.shape[1]
        self.calls.append({"num_splits": num_splits, "max_q": max_q, "max_k": max_k, "segments": segments,
                           "new_tokens": int(cu_seq_q[-1])})
        out = torch.empty_like(query)
        for i in range(segments):
            start, stop = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
            n, m = stop - start, int(seqused_k[i])
            assert 1 <= n <= max_q and n <= m <= max_k
            pages = block_table[i, : -(-m // page)].long()
            assert int(pages.max()) < key.shape[0]
            keys = key[pages].flatten(0, 1)[:m].transpose(0, 1)  # [H_kv, m, D]: its first m tokens only
            values = value[pages].flatten(0, 1)[:m].transpose(0, 1)
            q = query[start:stop].transpose(0, 1)  # [H_q, n, D]
            mask = torch.ones(n, m, dtype=torch.bool, device=query.device).tril(diagonal=m - n)
            o = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                               enable_gqa=enable_gqa)
            out[start:stop] = o[0].transpose(0, 1)
        return out


class GatheredContract:
    """A stand-in for torch 2.11's `varlen_attn`, which reads contiguous keys only: key/value
    [T_k, H_kv, D] with every segment's keys back to back (`cu_seq_k`), causal asked by
    `window_size=(-1, 0)` (bottom-right aligned), grouped heads the kernel's own (flash attention
    takes H_q a multiple of H_kv; 2.11 has no `enable_gqa`). `top_left` computes the other causal
    alignment instead: a kernel that takes the right parameters and computes otherwise (the probe's
    control). `calls` keeps each call's bounds and key count."""

    def __init__(self, top_left: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.top_left = top_left

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1)):
        assert tuple(window_size) == (-1, 0), "causal"
        return self.attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)

    def attend(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale):
        assert cu_seq_q.dtype == torch.int32 and cu_seq_k.dtype == torch.int32
        assert query.dim() == 3 and key.dim() == 3 and key.shape == value.shape and key.shape[0] == int(cu_seq_k[-1])
        assert key.is_contiguous() and value.is_contiguous()
        num_heads, kv_heads = query.shape[1], key.shape[1]
        assert num_heads % kv_heads == 0
        segments = len(cu_seq_q) - 1
        assert cu_seq_k.shape == (segments + 1,)
        self.calls.append({"max_q": max_q, "max_k": max_k, "segments": segments, "keys": key.shape[0]})
        out = torch.empty_like(query)
        for i in range(segments):
            start, stop = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
            k_start, k_stop = int(cu_seq_k[i]), int(cu_seq_k[i + 1])
            n, m = stop - start, k_stop - k_start
            assert 1 <= n <= max_q and n <= m <= max_k
            q = query[start:stop].transpose(0, 1)
            keys, values = key[k_start:k_stop].transpose(0, 1), value[k_start:k_stop].transpose(0, 1)
            mask = torch.ones(n, m, dtype=torch.bool, device=query.device).tril(diagonal=0 if self.top_left else m - n)
            o = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                               enable_gqa=num_heads != kv_heads)
            out[start:stop] = o[0].transpose(0, 1)
        return out


class GatheredContractIsCausal(GatheredContract):
    """torch 2.10's signature of the same function: causal by `is_causal=True`, no window."""

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 is_causal=False):
        assert is_causal
        return self.attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)
