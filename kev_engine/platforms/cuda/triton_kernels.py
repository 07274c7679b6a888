"""Batch-invariant CUDA kernels in Triton: the Linear product and RMSNorm (alone or after the
residual add), one order per output.

Where this sits: imported (it needs Triton) only by `invariant`, for a batch-invariant CUDA
engine. Why: cuBLAS picks its kernel, tile and split-K by the row count, and torch's reductions
pick their thread layout by the number of rows, so a question's numbers move with the pack
(Thinking Machines, "Defeating Nondeterminism in LLM Inference"; their `batch_invariant_ops`
replaces the same ops). Here every launch uses one fixed tile configuration, chosen by nothing
but the dtype: an output element is the same K loop of the same tile-sized `tl.dot`s (padding
rows and columns are masked zeros) whether its row came alone or with 5,000 others.

Under `TRITON_INTERPRET=1` the same kernels run on CPU tensors (tests/test_cuda_triton.py):
their plumbing, not the GPU's arithmetic.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (tests)
# one configuration for every shape: the point of the kernel. The interpreter pays per program,
# not per element, so there the output tiles are wider (a vocabulary of 49,152 in 48 programs)
BLOCK_M, BLOCK_N, BLOCK_K = 64, (1024 if INTERPRETED else 64), 64
NUM_WARPS, NUM_STAGES = 4, 3
FP_FUSION = True  # multiply-adds fused by choice, not by the Triton release's default (it changes in 3.10)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count, 1 included
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):  # always from the first K chunk to the last: one order
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K),
                    other=0.0)
        if UPCAST:  # Triton's interpreter cannot dot half tiles; their fp32 copies hold the same values
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:  # float32 models: true fp32 products, not TF32
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _normed(x, w_ptr, cols, mask, H, eps, DTYPE: tl.constexpr):
    """One row x (fp32 tile of the model's values) times the weight, as LlamaRMSNorm computes it."""
    variance = tl.sum(x * x, axis=0) / H  # one tree over one row: its shape is fixed by H alone
    normed = (x * (1.0 / tl.sqrt(variance + eps))).to(DTYPE)  # LlamaRMSNorm rounds here
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return w.to(tl.float32) * normed.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = _normed(x, w_ptr, cols, mask, H, eps, x_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, y_ptr, H, stride_x, stride_d, stride_h, stride_y, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + d).to(h_ptr.dtype.element_ty)  # the residual, rounded as torch's add rounds it
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    y = _normed(h.to(tl.float32), w_ptr, cols, mask, H, eps, h_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., K], weight [N, K] → [..., N], fp32 accumulation."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, K = rows.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _linear_kernel[grid](rows, weight, bias if bias is not None else weight, out, M, N, K, rows.stride(0),
                             weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                             IEEE=x.dtype == torch.float32, UPCAST=INTERPRETED and x.dtype != torch.float32,
                             BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                             num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=FP_FUSION)
    return out.view(*x.shape[:-1], N)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as rows [n, H] whose last dim is contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: weight * (x / sqrt(mean(x²) + eps)).to(x.dtype), over the last dim."""
    H = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, H, rows.stride(0), out.stride(0), eps,
                                           BLOCK=triton.next_power_of_2(H), enable_fp_fusion=FP_FUSION)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = x + delta` and `rms_norm(h, weight, eps)` in one launch: a layer's residual add and the
    norm after it (x, delta [T, H] in one dtype). h has torch's add's bits, the norm `rms_norm`'s."""
    H = x.shape[-1]
    rows, deltas = _rows(x), _rows(delta)
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](rows, deltas, weight, total, out, H, rows.stride(0), deltas.stride(0),
                                               total.stride(0), out.stride(0), eps,
                                               BLOCK=triton.next_power_of_2(H), enable_fp_fusion=FP_FUSION)
    return total.view(x.shape), out.view(x.shape)
