"""A GGUF's quantized blocks multiplied in place by Triton: the GPU's side of weights as they ship.

Where this sits: beside `triton_kernels.linear`, the fixed-order product of batch-invariant CUDA
engines; not yet used by an engine (a CUDA engine refuses `weights="as-stored"`, and says so): the
kernel and its proof come first, tested under Triton's interpreter and compiled for sm_80/sm_90
in the CPU suite.

The weight stays in the file's layout, [out_features, bytes a row]: each output row's blocks one
after another (Q8_0: an fp16 scale and 32 int8 values in 34 bytes; Q4_0: a scale and 32 four-bit
values in 18; Q4_1: a scale, a minimum and 32 four-bit values in 20). Each program decodes the
[BK, BN] tile of weights it needs, in registers, to exactly the value gguf's `dequantize` gives
(the same float32 operations: `q * d`, `d * q + m`, never fused into one multiply-add), rounds it
to the activations' dtype as torch does, and runs the dense kernel's step on it: the same tiles
for the weight's shape (`triton_kernels.tiles_for`), the same chunks of K summed in the same
order, the same `tl.dot`. So a row's result is the dense product's on the dequantized weight, bit
for bit, and as batch-invariant as it: one configuration for every row count. (A tile's chunks
are summed in one program here; the dense kernel's spreading of them over programs for a few rows
is not written for blocks yet.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import INTERPRETED, as_rows, tiles_for

FORMATS = {"Q8_0": (0, 34), "Q4_0": (1, 18), "Q4_1": (2, 20)}  # name → (kernel's code, bytes a block of 32)
BLOCK = 32  # weights a block


@triton.jit
def _half(ptr, at, mask):
    """The little-endian fp16 at byte `at` of a uint8 pointer, as float32."""
    lo = tl.load(ptr + at, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + at + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quant_chunk(x_ptr, q_ptr, rows, cols, M, N, K, start, stop, stride_xm, stride_qn, FORMAT: tl.constexpr,
                 BLOCK_BYTES: tl.constexpr, BF16: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A tile's sum over K in [start, stop), decoding the blocks: `triton_kernels._chunk`'s steps."""
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(start, stop, BK):  # from the chunk's first step to its last: the dense kernel's order
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        inside = (cols[None, :] < N) & (k[:, None] < K)
        block = q_ptr + cols[None, :] * stride_qn + (k[:, None] // 32) * BLOCK_BYTES  # [BK, BN] block starts
        j = k[:, None] % 32
        d = _half(block, 0, inside)
        if FORMAT == 0:  # Q8_0: q * d
            q = tl.load(block + 2 + j, mask=inside, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            w = q * d
        else:
            packed = tl.load(block + (2 if FORMAT == 1 else 4) + j % 16, mask=inside, other=0)
            nibble = tl.where(j < 16, packed & 15, packed >> 4).to(tl.float32)
            if FORMAT == 1:  # Q4_0: d * (q - 8)
                w = d * (nibble - 8.0)
            else:  # Q4_1: d * q + m, two roundings (the kernel is compiled without FMA contraction)
                w = d * nibble + _half(block, 2, inside)
        w = tl.where(inside, w, 0.0)
        if BF16:  # rounded to nearest, ties to even, as torch rounds: by the bits (the interpreter's cast truncates)
            bits = w.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            w = bits.to(tl.float32, bitcast=True)
        w = w.to(x_ptr.dtype.element_ty)  # exact: the value is the dtype's already
        if UPCAST:  # Triton's interpreter cannot dot half tiles; their fp32 copies hold the same values
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    return acc


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count, 1 included
def _quant_linear_kernel(x_ptr, q_ptr, y_ptr, M, N, K, CHUNK, stride_xm, stride_qn, stride_ym,
                         FORMAT: tl.constexpr, BLOCK_BYTES: tl.constexpr, BF16: tl.constexpr, IEEE: tl.constexpr,
                         UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A tile a program, its chunks of K summed apart and added in turn: `triton_kernels._linear_kernel`."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = _quant_chunk(x_ptr, q_ptr, rows, cols, M, N, K, 0, tl.minimum(CHUNK, K), stride_xm, stride_qn, FORMAT,
                       BLOCK_BYTES, BF16, IEEE, UPCAST, BM, BN, BK)
    for start in range(CHUNK, K, CHUNK):
        acc += _quant_chunk(x_ptr, q_ptr, rows, cols, M, N, K, start, tl.minimum(start + CHUNK, K), stride_xm,
                            stride_qn, FORMAT, BLOCK_BYTES, BF16, IEEE, UPCAST, BM, BN, BK)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, format: str, in_features: int) -> torch.Tensor:
    """`x @ W.T` for x [..., K] and W [N, K] stored as `format`'s blocks, `blocks` [N, K / 32 × block
    bytes] uint8 (a GGUF tensor's bytes, row by row) → [..., N], fp32 accumulation."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not allowed; use one of {list(FORMATS)}")
    code, block_bytes = FORMATS[format]
    if in_features % BLOCK or blocks.dtype != torch.uint8 or blocks.shape[1] != in_features // BLOCK * block_bytes:
        raise ValueError(f"{format} blocks of {in_features} weights a row are {in_features // BLOCK * block_bytes} "
                         f"uint8 bytes a row; got {tuple(blocks.shape)} {blocks.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features; the weight takes {in_features}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x is {x.dtype}; the quantized product computes float32 and bfloat16")
    rows = as_rows(x)  # [M, in_features]: its last dim checked above
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    M, N = rows.shape[0], blocks.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        tiles = tiles_for(N, in_features, x.dtype)  # the dense product's on this weight shape
        grid = (triton.cdiv(M, tiles.bm), triton.cdiv(N, tiles.bn))
        _quant_linear_kernel[grid](rows, blocks, out, M, N, in_features, tiles.chunk, rows.stride(0), blocks.stride(0),
                                   out.stride(0), FORMAT=code, BLOCK_BYTES=block_bytes, BF16=x.dtype == torch.bfloat16,
                                   IEEE=x.dtype == torch.float32, UPCAST=INTERPRETED and x.dtype != torch.float32,
                                   BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, num_warps=tiles.warps,
                                   num_stages=tiles.stages, enable_fp_fusion=False)
    return out.view(*x.shape[:-1], N)

