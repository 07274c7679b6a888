"""csrc/quant_scaled.cpp's block-scaled arithmetic written out in numpy, for tests/test_quant.py.

Each weight of group g is S_g * q + O'_g; a row's output is, from acc = 0, for each group in order
p = fma(x[k], q[k], p) over the group's k in order (from p = 0), acc = fma(S_g, p, acc), then
acc = fma(O'_g, sx_g, acc) where sx_g is x's sum over the group (adds in order). A fused
multiply-add of fp32 values is computed here in float64 (the product is exact there) and rounded
once to fp32; the sum can round twice (to float64, then to fp32) where the fp32 result would not,
only when the float64 sum lands exactly halfway between two fp32 values, which random inputs do
not reach."""

from __future__ import annotations

import numpy as np
import torch

from kev_engine.models.quant import QuantTensor, values_and_scales

ZEROS = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}  # subtracted from each stored value


def _half(scales: np.ndarray, at: int) -> np.ndarray:
    return scales[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def group_scales(tensor: QuantTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q as fp32 [rows, cols], and each group's S and O' as fp32 [rows, groups of a row], as gguf computes them."""
    f = tensor.format
    values, scales = values_and_scales(tensor)
    if f.name == "Q8_0":
        q = values.view(np.int8).astype(np.float32)
    else:
        q = values.astype(np.float32) - np.float32(ZEROS.get(f.name, 0))
    if f.name in ("Q4_0", "Q5_0", "Q8_0"):
        scale, offset = _half(scales, 0), np.zeros(scales.shape[:2], np.float32)
    elif f.name in ("Q4_1", "Q5_1"):
        scale, offset = _half(scales, 0), _half(scales, 2)
    elif f.name in ("Q4_K", "Q5_K"):  # six-bit scales and mins of 8 groups, packed in 12 bytes
        d, dmin = _half(scales, 0)[..., None], _half(scales, 2)[..., None]
        b = scales[..., 4:16].astype(np.uint32)
        sc = np.concatenate([b[..., 0:4] & 0x3F, (b[..., 8:12] & 0x0F) | ((b[..., 0:4] >> 2) & 0x30)], axis=-1)
        mn = np.concatenate([b[..., 4:8] & 0x3F, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 2) & 0x30)], axis=-1)
        scale, offset = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
    else:  # Q6_K: 16 signed eight-bit scales, then d
        scale = _half(scales, 16)[..., None] * scales[..., :16].view(np.int8).astype(np.float32)
        offset = np.zeros_like(scale)
    return q, scale.astype(np.float32).reshape(tensor.rows, -1), offset.astype(np.float32).reshape(tensor.rows, -1)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _dot_pair(x: np.ndarray, q: np.ndarray, k: int, p: np.ndarray) -> np.ndarray:
    """`vdpbf16ps` on the pair k, k + 1: p + x[k+1] * q[k+1], then + x[k] * q[k], each rounded to fp32
    (the instruction's order and rounding; a product of bf16s is exact in fp32; random inputs meet
    no subnormal, which it would flush)."""
    p = _fma(x[:, k + 1:k + 2], q[None, :, k + 1], p)
    return _fma(x[:, k:k + 1], q[None, :, k], p)


def scaled_product(x: torch.Tensor, parts: list[QuantTensor], bias: torch.Tensor | None = None,
                   dot: bool = False) -> torch.Tensor:
    """x [m, k] @ the parts stacked, as csrc/quant_scaled.cpp computes it, in x's dtype; `dot`: a
    group's sums as `vdpbf16ps` takes them (the AVX512-BF16 path's bf16 products)."""
    rows = x.float().numpy()
    outs = []
    for part in parts:
        q, scale, offset = group_scales(part)
        group = part.cols // scale.shape[1]
        acc = np.zeros((rows.shape[0], part.rows), np.float32)
        for g in range(scale.shape[1]):
            p = np.zeros_like(acc)
            sx = np.zeros((rows.shape[0], 1), np.float32)
            for k in range(g * group, (g + 1) * group):
                if not dot:
                    p = _fma(rows[:, k:k + 1], q[None, :, k], p)
                elif k % 2 == 0:
                    p = _dot_pair(rows, q, k, p)
                sx = (sx + rows[:, k:k + 1]).astype(np.float32)
            acc = _fma(scale[None, :, g], p, acc)
            if offset.any():
                acc = _fma(offset[None, :, g], sx, acc)
        outs.append(acc)
    out = torch.from_numpy(np.concatenate(outs, axis=1))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
