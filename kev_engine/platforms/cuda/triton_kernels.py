"""Batch-invariant CUDA kernels in Triton: the Linear product and RMSNorm (alone or after the
residual add), one order per output.

Where this sits: imported (it needs Triton) only by `invariant`, for a batch-invariant CUDA
engine. Why: cuBLAS picks its kernel, tile and split-K by the row count, and torch's reductions
pick their thread layout by the number of rows, so a question's numbers move with the pack
(Thinking Machines, "Defeating Nondeterminism in LLM Inference"; their `batch_invariant_ops`
replaces the same ops). Here a product's configuration (`Tiles`) is a function of its weight's
shape and dtype, never of the rows: an output element is the same K loop of the same tile-sized
`tl.dot`s, in chunks of K summed apart and added first to last (padding rows and columns are
masked zeros), whether its row came alone or with 5,000 others. A few rows (a decode step) give
each chunk a program of its own and add the chunks in a second launch, so the SMs are busy; many
rows sum a tile's chunks in one program: the same sums and the same adds, so the same bits.

Under `TRITON_INTERPRET=1` the same kernels run on CPU tensors (tests/test_cuda_triton.py):
their plumbing, not the GPU's arithmetic.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (tests)
FP_FUSION = True  # multiply-adds fused by choice, not by the Triton release's default (it changes in 3.10)
# The small tiles, for the shapes of small models and the product on a GGUF's blocks (`triton_quant`).
# The interpreter pays per program, not per element, so there the output tiles are wider (a
# vocabulary of 49,152 in 48 programs)
BLOCK_M, BLOCK_N, BLOCK_K = 64, (1024 if INTERPRETED else 64), 64
NUM_WARPS, NUM_STAGES = 4, 3
TARGET_PROGRAMS = 128  # about one wave of an H100's or H200's 132 SMs (an A100's 108)
MIN_CHUNK = 512  # K a chunk sums at the least: 8 steps of 64, enough for the loads' pipeline


@dataclass(frozen=True)
class Tiles:
    """One product's configuration: its output tile (bm x bn), its K step (bk), and the K chunks
    it sums apart then adds in order (`chunk`, a multiple of bk; K itself where it has one). A
    function of the weight's shape and the dtype only (`tiles_for`), never of the rows: that is
    the invariance."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    chunk: int

    def splits(self, k: int) -> int:
        return triton.cdiv(k, self.chunk)


@functools.cache  # a few shapes a model, asked at every product
def tiles_for(n: int, k: int, dtype: torch.dtype) -> Tiles:
    """The tiles of a weight [n, k] in `dtype`. Large half-precision weights take 128 x 128 tiles
    of 8 warps, the usual configuration for many rows on tensor cores (as in Triton's matmul
    tutorial); the others 64 x 64 of 4. K is cut in chunks where a few rows' tiles (a decode step)
    would leave most SMs idle: enough chunks for `TARGET_PROGRAMS` programs, none shorter than
    `MIN_CHUNK`. How near the device's rate each shape comes is a GPU's measurement (`make
    gpu-check` times every weight shape of its model at 4,096 rows and at 16)."""
    big = dtype != torch.float32 and n >= 1024 and k >= 1024 and not INTERPRETED
    bm, bn, warps = (128, 128, 8) if big else (BLOCK_M, BLOCK_N, NUM_WARPS)
    steps = triton.cdiv(k, BLOCK_K)
    wanted = triton.cdiv(TARGET_PROGRAMS, triton.cdiv(n, bn))
    splits = max(1, min(wanted, steps // max(1, MIN_CHUNK // BLOCK_K)))
    return Tiles(bm, bn, BLOCK_K, warps, NUM_STAGES, triton.cdiv(steps, splits) * BLOCK_K)


@triton.jit
def _chunk(x_ptr, w_ptr, rows, cols, M, N, K, start, stop, stride_xm, stride_wn, IEEE: tl.constexpr,
           UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A tile's sum over K in [start, stop): from its first step of BK to its last, one order."""
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(start, stop, BK):
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
    return acc


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count, 1 included
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, CHUNK, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A tile a program: every chunk of K summed apart, in turn, and added first to last."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = _chunk(x_ptr, w_ptr, rows, cols, M, N, K, 0, tl.minimum(CHUNK, K), stride_xm, stride_wn, IEEE, UPCAST,
                 BM, BN, BK)
    for start in range(CHUNK, K, CHUNK):
        acc += _chunk(x_ptr, w_ptr, rows, cols, M, N, K, start, tl.minimum(start + CHUNK, K), stride_xm, stride_wn,
                      IEEE, UPCAST, BM, BN, BK)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _chunk_kernel(x_ptr, w_ptr, p_ptr, M, N, K, CHUNK, stride_xm, stride_wn, IEEE: tl.constexpr,
                  UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A chunk of a tile a program, its fp32 sum to partials [chunks, M, N]: `_linear_kernel`'s
    sums, spread over more programs where the rows are few."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    start = tl.program_id(2) * CHUNK
    acc = _chunk(x_ptr, w_ptr, rows, cols, M, N, K, start, tl.minimum(start + CHUNK, K), stride_xm, stride_wn,
                 IEEE, UPCAST, BM, BN, BK)
    tl.store(p_ptr + (tl.program_id(2) * M + rows[:, None]) * N + cols[None, :], acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _add_chunks_kernel(p_ptr, b_ptr, y_ptr, M, N, CHUNKS, stride_ym, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Each output's chunk sums added first to last, then the bias: `_linear_kernel`'s adds."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(p_ptr + row * N + cols, mask=mask, other=0.0)
    for chunk in range(1, CHUNKS):
        acc += tl.load(p_ptr + (chunk * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


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


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as rows [n, H] whose last dim is contiguous: what every kernel here reads."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: Tiles | None = None,
           spread: bool | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., K], weight [N, K] → [..., N], fp32 accumulation.

    `tiles`: the weight's (`tiles_for`, unless given). Where K has several chunks and the rows'
    tiles would leave SMs idle (a decode step), each chunk is a program of its own and a second
    launch adds the chunks (`spread`; None: by that rule): the same sums added in the same order,
    so the same bits as one program a tile summing its chunks in turn."""
    rows = as_rows(x)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, K = rows.shape
    N = weight.shape[0]
    tiles = tiles or tiles_for(N, K, weight.dtype)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if not M:
        return out.view(*x.shape[:-1], N)
    tiled = (triton.cdiv(M, tiles.bm), triton.cdiv(N, tiles.bn))
    chunks = tiles.splits(K)
    if spread is None:
        spread = chunks > 1 and tiled[0] * tiled[1] < TARGET_PROGRAMS
    shared = dict(IEEE=x.dtype == torch.float32, UPCAST=INTERPRETED and x.dtype != torch.float32, BM=tiles.bm,
                  BN=tiles.bn, BK=tiles.bk, num_warps=tiles.warps, num_stages=tiles.stages,
                  enable_fp_fusion=FP_FUSION)
    if spread:
        partials = torch.empty(chunks, M, N, dtype=torch.float32, device=x.device)
        _chunk_kernel[(*tiled, chunks)](rows, weight, partials, M, N, K, tiles.chunk, rows.stride(0),
                                        weight.stride(0), **shared)
        _add_chunks_kernel[(M, triton.cdiv(N, ADD_BLOCK))](partials, bias if bias is not None else weight, out, M, N,
                                                           chunks, out.stride(0), HAS_BIAS=bias is not None,
                                                           BLOCK=ADD_BLOCK, enable_fp_fusion=FP_FUSION)
    else:
        _linear_kernel[tiled](rows, weight, bias if bias is not None else weight, out, M, N, K, tiles.chunk,
                              rows.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, **shared)
    return out.view(*x.shape[:-1], N)


ADD_BLOCK = 1024  # outputs a program of `_add_chunks_kernel` adds


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: weight * (x / sqrt(mean(x²) + eps)).to(x.dtype), over the last dim."""
    H = x.shape[-1]
    rows = as_rows(x)
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
    rows, deltas = as_rows(x), as_rows(delta)
    total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](rows, deltas, weight, total, out, H, rows.stride(0), deltas.stride(0),
                                               total.stride(0), out.stride(0), eps,
                                               BLOCK=triton.next_power_of_2(H), enable_fp_fusion=FP_FUSION)
    return total.view(x.shape), out.view(x.shape)
