"""Kev's paged attention in Triton: every query row of a pass over its own keys, read in place from the pool.

Where this sits: the kernel of `triton_paged.TritonBackend`, the CUDA attention that needs no
paged `varlen_attn` (torch 2.10 and 2.11 have none), so decode passes replay as CUDA graphs on
every torch with Triton. The pool is [num_blocks, block_size, kv_heads, head_dim]; a segment's
keys are its first `seqused_k` positions, read through its row of `block_table`; its new tokens
are the last of them (causal, bottom-right aligned: a chunk continues its own cached prefix).

One program per (segment, tile of its new tokens, key head). A tile's rows are (token, query head
of that key head) pairs, `ROWS` of them: a decode row's grouped heads fill one tile, so their keys
are read once. The program walks the keys in blocks of `BLOCK_N` from position 0, an online
softmax in float32 (flash attention's recurrence), to the last key its last token sees.

Batch invariance, by construction: a row's numbers come from its own query and its own keys in
one fixed order — key blocks aligned to position 0, the same tile shapes and the same reductions
whatever the pass holds. What the pass changes is only which other rows share the tile and how
far the tile walks; a key block past a row's own position is masked to -inf, and then adds
exactly nothing (its maximum stays, the rescale factor is exp(0) = 1, the probabilities are 0 and
the values they multiply are finite: only written slots are read). So a question's attention is
the same bits alone, packed, chunked differently, or replayed in a graph bucket with padding rows.
No key split: a long context is one program's walk.

`DOT`: the scores and the weighted values by `tl.dot` (tensor cores: the GPU's path), or by
elementwise products and a sum over one axis (Triton's interpreter: numpy's matrix product may
sum a row in another order by its place in the tile, its elementwise sum does not).
`shape_dependent` is the control: key blocks whose width follows the pass's segment count, so a
question's sums are split where the pack decides — packed differs from alone by construction.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (tests)
BLOCK_N = 64  # keys per step, aligned to position 0: part of the order, the same for every pass
MIN_ROWS = 16  # tl.dot's smallest tile height
NUM_WARPS = 4
# multiply-adds fused (FMA) by choice, not by the Triton release's default (which changes in 3.10):
# the compiled arithmetic, and so the bits, the same on every Triton
FP_FUSION = True


# the arguments a pass changes (the query's head stride is its token count × head_dim, the table's
# row its widest segment's blocks) are not specialized on: one compiled kernel for every pass
@triton.jit(do_not_specialize=["stride_qh", "stride_table"])
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, seqused_ptr, table_ptr, scale,
                            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                            stride_ot, stride_oh, stride_table,
                            GROUP: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
                            IEEE: tl.constexpr):
    seg = tl.program_id(0)
    kv_head = tl.program_id(2)
    q_stop = tl.load(cu_q_ptr + seg + 1)
    first = tl.load(cu_q_ptr + seg) + tl.program_id(1) * TOKENS
    if first < q_stop:  # segments shorter than the pass's longest leave their later tiles idle
        kv_len = tl.load(seqused_ptr + seg)
        r = tl.arange(0, ROWS)
        token = first + r // GROUP
        head = kv_head * GROUP + r % GROUP
        live = (r < TOKENS * GROUP) & (token < q_stop)
        position = tl.where(live, kv_len - q_stop + token, 0)  # the last key this row sees (padding: key 0)
        d = tl.arange(0, BLOCK_D)
        in_d = d < HEAD_DIM
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=live[:, None] & in_d[None, :], other=0.0)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        end = kv_len - q_stop + tl.minimum(first + TOKENS, q_stop)  # keys the tile's last token sees
        for start in range(0, end, BN):
            n = start + tl.arange(0, BN)
            in_n = n < end
            page = tl.load(table_ptr + seg * stride_table + n // PAGE, mask=in_n, other=0)
            slot = n % PAGE
            both = in_n[:, None] & in_d[None, :]
            k_at = page[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            v_at = page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :]
            k = tl.load(k_ptr + k_at, mask=both, other=0.0)
            v = tl.load(v_ptr + v_at, mask=both, other=0.0)
            if DOT:
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
            else:
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            s = tl.where(n[None, :] <= position[:, None], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p = p.to(v.dtype)  # the values' precision for their product, as flash attention
            if DOT:
                if IEEE:
                    pv = tl.dot(p, v, input_precision="ieee")
                else:
                    pv = tl.dot(p, v)
            else:
                pv = tl.sum(p.to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=live[:, None] & in_d[None, :])


def tile_rows(group: int) -> tuple[int, int]:
    """(rows, tokens) of a tile for `group` query heads per key head: a power of two ≥ 16 rows,
    as many whole tokens as fit. Fixed by the model's shape, never by the pass."""
    rows = max(MIN_ROWS, triton.next_power_of_2(group))
    return rows, rows // group


def paged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seqused_k: torch.Tensor, block_table: torch.Tensor, max_seqlen_q: int, scale: float | None,
                    dot: bool | None = None, shape_dependent: bool = False) -> torch.Tensor:
    """Causal attention of each segment's new queries over its paged keys: query [T, H, D], keys and
    values [num_blocks, block_size, kvH, D], `cu_seqlens_q` [S+1] int32, `seqused_k` [S] int32
    (keys each segment sees, its new ones included), `block_table` [S, width] int32 → [T, H, D].

    `max_seqlen_q` (a host int, at least the longest segment's new tokens) sizes the grid; `dot`
    None: tensor cores on a GPU, the elementwise form under the interpreter; `shape_dependent`: the
    control (see the module's docstring)."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    tokens, heads, head_dim = query.shape
    _, page, kv_heads, _ = keys.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} key heads")
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("the pool's head_dim and the block table's rows must be contiguous")
    group = heads // kv_heads
    rows, per_tile = tile_rows(group)
    segments = cu_seqlens_q.shape[0] - 1
    out = torch.empty_like(query)
    if tokens == 0 or segments == 0:
        return out
    use_dot = not INTERPRETED if dot is None else dot
    upcast = INTERPRETED and use_dot and query.dtype != torch.float32  # the interpreter dots float32 tiles only
    if upcast:
        query, keys, values = query.float(), keys.float(), values.float()
    width = BLOCK_N if not shape_dependent else (16 if segments > 1 else BLOCK_N)
    grid = (segments, triton.cdiv(max_seqlen_q, per_tile), kv_heads)
    target = out if not upcast else torch.empty_like(query)
    _paged_attention_kernel[grid](
        query, keys, values, target, cu_seqlens_q, seqused_k, block_table,
        float(head_dim ** -0.5 if scale is None else scale),
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), target.stride(0), target.stride(1),
        block_table.stride(0),
        GROUP=group, TOKENS=per_tile, ROWS=rows, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page, BN=width, DOT=use_dot, IEEE=query.dtype == torch.float32, num_warps=NUM_WARPS,
        enable_fp_fusion=FP_FUSION,
    )
    if upcast:
        out.copy_(target)
    return out
