"""A layer's elementwise steps in Triton, one launch each: the rotary embedding of the queries and
keys together, and the MLP's silu(gate) * up.

Where this sits: `ops.InvariantOps` computes Kev's model's rotary and activation with these on a
batch-invariant CUDA engine (the norms and products are `triton_kernels`'). Why: written in torch's
ops, the rotary is five launches a tensor (negate, concatenate, two products, a sum) and the
activation two; a decode step of a small model is bound by launches, one per op per layer, so the
step replayed as a CUDA graph (`graphs`) is shorter by every launch saved here.

Invariant by construction: each output element is one formula of its own inputs, the same
whatever the pack. The formulas are `models.ops.Ops`' with each of torch's roundings kept (every
product and sum rounded to the tensor's dtype where torch's ops round it), and compiled without
fused multiply-adds, so the rotary's bits are torch's (tests/test_cuda_triton.py, in the
interpreter); silu's exp and division are the GPU's own forms, within an ulp or two of torch's
before the rounding to the model's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP_FUSION = False  # torch rounds each product before the sum; a fused multiply-add would not


@triton.jit
def _rotate(x_ptr, y_ptr, c1, s1, c2, s2, heads, half, stride_x, stride_y, HEADS: tl.constexpr, HALF: tl.constexpr):
    """One token's heads [heads, 2 * half] rotated by its cos/sin halves: torch's
    `x * cos + rotate_half(x) * sin`, each product and the sum rounded to the output's dtype."""
    dtype = y_ptr.dtype.element_ty
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = (h < heads) & (d < half)
    x1 = tl.load(x_ptr + h * stride_x + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + h * stride_x + half + d, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    y2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(y_ptr + h * stride_y + d, y1.to(dtype), mask=mask)
    tl.store(y_ptr + h * stride_y + half + d, y2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, q_heads, k_heads, half, stride_qt, stride_qh,
                   stride_kt, stride_kh, stride_ct, stride_qot, stride_qoh, stride_kot, stride_koh,
                   Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0)
    d = tl.arange(0, HALF)[None, :]
    mask = d < half
    row = cos_ptr + token * stride_ct
    c1 = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(row + half + d, mask=mask, other=0.0).to(tl.float32)
    row = sin_ptr + token * stride_ct
    s1 = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(row + half + d, mask=mask, other=0.0).to(tl.float32)
    _rotate(q_ptr + token * stride_qt, qo_ptr + token * stride_qot, c1, s1, c2, s2, q_heads, half, stride_qh,
            stride_qoh, Q_HEADS, HALF)
    _rotate(k_ptr + token * stride_kt, ko_ptr + token * stride_kot, c1, s1, c2, s2, k_heads, half, stride_kh,
            stride_koh, K_HEADS, HALF)


@triton.jit
def _silu_mul_kernel(g_ptr, y_ptr, width, stride_g, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype = y_ptr.dtype.element_ty
    gate = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(g_ptr + row * stride_g + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # F.silu: in float32, rounded to the dtype
    tl.store(y_ptr + row * stride_y + cols, (silu.to(tl.float32) * up).to(dtype), mask=mask)


SILU_BLOCK = 1024  # columns a program: a row of an intermediate width of 4,864 in 5 programs


def rotary_qk(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, heads, D] and key [T, kv_heads, D] (any token and head strides; the last dim
    contiguous) rotated by their rows' cos, sin [T, D], in one launch: new tensors."""
    tokens, q_heads, dim = query.shape
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    dtype = torch.promote_types(query.dtype, cos.dtype)
    q_out = torch.empty(query.shape, dtype=dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=torch.promote_types(key.dtype, cos.dtype), device=key.device)
    if tokens:
        half = dim // 2
        _rotary_kernel[(tokens,)](query, key, cos, sin, q_out, k_out, q_heads, key.shape[1], half, query.stride(0),
                                  query.stride(1), key.stride(0), key.stride(1), cos.stride(0), q_out.stride(0),
                                  q_out.stride(1), k_out.stride(0), k_out.stride(1),
                                  Q_HEADS=triton.next_power_of_2(q_heads), K_HEADS=triton.next_power_of_2(key.shape[1]),
                                  HALF=triton.next_power_of_2(half), enable_fp_fusion=FP_FUSION)
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """gate_up [T, 2 * width] (the last dim contiguous) → silu(gate) * up [T, width]."""
    rows = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    out = torch.empty(rows.shape[0], width, dtype=rows.dtype, device=rows.device)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(width, SILU_BLOCK))
        _silu_mul_kernel[grid](rows, out, width, rows.stride(0), out.stride(0), BLOCK=SILU_BLOCK,
                               enable_fp_fusion=FP_FUSION)
    return out
