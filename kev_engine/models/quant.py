"""GGUF's quantized weights as Kev keeps them: the file's blocks, reordered for its CPU products.

Where this sits: `gguf_file.GgufFile` hands the model a `QuantTensor` for each quantized weight
(the file's bytes, rows in transformers' order); `layout.Linear.read` makes a `QuantWeight` of a
product's parts, and the CPU platform's ops compute with it (`csrc/quant.cpp`), never a dense copy.

Why a layout of Kev's: the file stores each output row's blocks one after another; a product that
decodes 16 outputs' k-th weights as one vector wants them side by side. `tile` moves the same bytes
(a block's scales as the file has them; 4-bit values, and the 5- and 6-bit formats' low four bits,
a row's eight k to a dword, the even k low and the odd k high; fifth and sixth bits in planes of
their own) into panels of 16 outputs, the layout csrc/quant_blocks.h documents: the memory a
weight takes is the file's bytes (padding aside: a last panel of fewer than 16 outputs, and an odd
panel count, filled with zero bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

LANES = 16  # outputs a panel


@dataclass(frozen=True)
class Format:
    """A GGML block type Kev computes in place: `block_k` weights in `block_bytes`, `scale_bytes`
    of them a block's scales, and the bits of each stored value (low 4 or 8, high 0-2)."""

    name: str
    block_k: int
    block_bytes: int
    scale_bytes: int
    low_bits: int
    high_bits: int


FORMATS: dict[int, Format] = {  # GGML type id → format
    2: Format("Q4_0", 32, 18, 2, 4, 0),
    3: Format("Q4_1", 32, 20, 4, 4, 0),
    6: Format("Q5_0", 32, 22, 2, 4, 1),
    7: Format("Q5_1", 32, 24, 4, 4, 1),
    8: Format("Q8_0", 32, 34, 2, 8, 0),
    12: Format("Q4_K", 256, 144, 16, 4, 0),
    13: Format("Q5_K", 256, 176, 16, 4, 1),
    14: Format("Q6_K", 256, 210, 18, 4, 2),
}


@dataclass
class QuantTensor:
    """A quantized weight [rows, cols] as the file stores it: `blocks` [rows, bytes a row]."""

    type: int  # GGML type id, a key of FORMATS
    rows: int
    cols: int
    blocks: np.ndarray  # uint8

    @property
    def format(self) -> Format:
        return FORMATS[self.type]

    def permuted_rows(self, order: np.ndarray) -> QuantTensor:
        """The same weight with its rows in `order` (rows are whole blocks: nothing is decoded)."""
        return QuantTensor(self.type, self.rows, self.cols, self.blocks[order])

    def dequantized(self) -> torch.Tensor:
        """fp32 [rows, cols] by gguf's own `dequantize` (the values Kev's products decode)."""
        from gguf import GGMLQuantizationType, quants

        values = quants.dequantize(np.ascontiguousarray(self.blocks), GGMLQuantizationType(self.type))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(self.rows, self.cols))


@dataclass
class QuantWeight:
    """A product's quantized parts in Kev's layout, stacked along the outputs (q | k | v)."""

    tiled: list[torch.Tensor]  # uint8, `tile`'s layout
    types: list[int]
    widths: list[int]  # each part's outputs
    in_features: int

    @classmethod
    def of(cls, parts: list[QuantTensor]) -> QuantWeight:
        cols = {part.cols for part in parts}
        if len(cols) != 1:
            raise ValueError(f"quantized parts of one product read different input widths: {sorted(cols)}")
        return cls([tile(part) for part in parts], [part.type for part in parts], [part.rows for part in parts],
                   cols.pop())

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel()) for t in self.tiled)

    @property
    def out_features(self) -> int:
        return sum(self.widths)


def values_and_scales(tensor: QuantTensor) -> tuple[np.ndarray, np.ndarray]:
    """Each weight's stored value (uint8 [rows, cols]: the low bits with the high ones above them;
    Q8_0's int8 as its byte) and each block's scale bytes (uint8 [rows, blocks, scale_bytes]), read
    from the file's blocks as gguf's `dequantize` reads them."""
    f = tensor.format
    b = np.ascontiguousarray(tensor.blocks).reshape(-1, f.block_bytes)
    n = b.shape[0]

    def nibbles(qs: np.ndarray) -> np.ndarray:  # 16 bytes → 32 values: the low nibbles, then the high
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)

    def fifth_bits(qh: np.ndarray) -> np.ndarray:  # 4 bytes → 32 bits, bit k the k-th value's
        bits = qh.copy().view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32)
        return (bits & 1).astype(np.uint8)

    if f.name in ("Q4_0", "Q4_1"):
        values = nibbles(b[:, f.scale_bytes:])
    elif f.name in ("Q5_0", "Q5_1"):
        qh, qs = b[:, f.scale_bytes:f.scale_bytes + 4], b[:, f.scale_bytes + 4:]
        values = nibbles(qs) | (fifth_bits(qh) << 4)
    elif f.name == "Q8_0":
        values = b[:, 2:].copy()
    elif f.name in ("Q4_K", "Q5_K"):  # 4 runs of 32 bytes, each two groups of 32 values (low nibbles, then high)
        low = np.stack([b[:, -128:].reshape(n, 4, 32) & 0x0F, b[:, -128:].reshape(n, 4, 32) >> 4], axis=2)
        values = low.reshape(n, 256)
        if f.name == "Q5_K":  # 32 bytes, bit g of byte i: group g's value i
            high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            values = values | (high.reshape(n, 256) << 4)
    elif f.name == "Q6_K":  # ql 128, qh 64, 16 scales, d
        ql = b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        values = (ql & 0x0F).reshape(n, 256) | ((qh & 0x03).reshape(n, 256) << 4)
    else:  # pragma: no cover - FORMATS lists what is handled
        raise ValueError(f"no values for {f.name}")
    scales = b[:, :f.scale_bytes] if f.name != "Q6_K" else b[:, 192:]  # Q6_K's scales and d come last
    blocks = tensor.cols // f.block_k
    return (values.reshape(tensor.rows, tensor.cols).astype(np.uint8),
            np.ascontiguousarray(scales).reshape(tensor.rows, blocks, f.scale_bytes))


def tile(tensor: QuantTensor) -> torch.Tensor:
    """The weight in csrc/quant_blocks.h's layout: uint8 [panels, blocks, 16 x the file's block bytes]."""
    f = tensor.format
    if tensor.cols % f.block_k:
        raise ValueError(f"a {f.name} weight of {tensor.cols} inputs: not a whole number of {f.block_k}-weight blocks")
    values, scales = values_and_scales(tensor)
    panels = -(-tensor.rows // (2 * LANES)) * 2
    blocks = tensor.cols // f.block_k
    pad = panels * LANES - tensor.rows
    values = np.pad(values, ((0, pad), (0, 0)))
    scales = np.pad(scales, ((0, pad), (0, 0), (0, 0)))
    # [panel, block, k, lane]: a k's 16 outputs side by side
    v = values.reshape(panels, LANES, blocks, f.block_k).transpose(0, 2, 3, 1)
    rows = scales.reshape(panels, LANES, blocks, f.scale_bytes).transpose(0, 2, 1, 3)  # [panel, block, lane, byte]
    if f.block_k == 256:  # the K-quants: dword i of every lane side by side (one load, not a gather), then Q6_K's d
        words = rows[..., :16].reshape(panels, blocks, LANES, 4, 4).transpose(0, 1, 3, 2, 4)
        planes = [words.reshape(panels, blocks, -1), rows[..., 16:].reshape(panels, blocks, -1)]
    else:
        planes = [rows.reshape(panels, blocks, -1)]
    if f.low_bits == 8:
        planes.append(v.reshape(panels, blocks, -1))
    else:  # per 8 k, dword j: row j's values at k 0, 2, 4, 6 (low nibble first), then 1, 3, 5, 7
        # [..., run, k % 8 // 4, k % 4 // 2, k % 2, lane]: byte k % 8 // 4 of a word, its nibble k % 4 // 2
        runs = (v & 0x0F).reshape(panels, blocks, f.block_k // 8, 2, 2, 2, LANES)
        nibbles = runs[..., 0, :, :] | runs[..., 1, :, :] << 4  # [..., run, byte, k % 2, lane]
        planes.append(nibbles.transpose(0, 1, 2, 5, 4, 3).reshape(panels, blocks, -1))
    if f.high_bits:  # per 8 k: [..., run, k % 8 // 2, k % 2, lane]
        h = (v >> 4).reshape(panels, blocks, f.block_k // 8, 4, 2, LANES)
        if f.high_bits == 1:  # a little-endian dword per pair of k: bit 2j (k even) or 2j + 1 row j's fifth bit
            bits = h.transpose(0, 1, 2, 3, 5, 4).reshape(panels, blocks, f.block_k // 8, 4, 2 * LANES)
            planes.append(np.packbits(bits, axis=-1, bitorder="little").reshape(panels, blocks, -1))
        else:  # byte 2j (k even) or 2j + 1: row j's two high bits at k from bit 2 * (k % 8 // 2)
            fields = h[..., 0, :, :] | h[..., 1, :, :] << 2 | h[..., 2, :, :] << 4 | h[..., 3, :, :] << 6
            planes.append(fields.transpose(0, 1, 2, 4, 3).reshape(panels, blocks, -1))
    tiled = np.concatenate(planes, axis=-1)
    assert tiled.shape[-1] == LANES * f.block_bytes, (f.name, tiled.shape)
    return torch.from_numpy(np.ascontiguousarray(tiled))
