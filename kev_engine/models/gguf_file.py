"""A GGUF file's tensors under transformers' names: quantized weights as the file stores them.

Where this sits: `load.from_gguf` reads a .gguf through this into Kev's model. A weight of a block
type Kev computes in place (`quant.FORMATS`) comes back as a `QuantTensor` of the file's bytes; any
other (F32 norms, F16, the types Kev does not compute) comes back dequantized by gguf's own
`dequantize`, and the file says which those were (`dequantized`), so the load can name them.

The names are gguf-py's own map between its names and transformers' (`get_tensor_name_map`), as
transformers' GGUF loader uses it; llama.cpp's converter interleaved the rows of the query and
key projections of "llama" files for its rotary layout, and those rows are put back in
transformers' order, as transformers' loader does (whole rows: a quantized row's blocks move
undecoded).

The header is read here (`read_header`), not by gguf-py's `GGUFReader`: that one builds a numpy
view of every metadata value, and a tokenizer's 50,000 strings took it seconds; here they are
skipped by their lengths.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .quant import FORMATS, QuantTensor

INTERLEAVED_QK = ("llama",)  # GGUF architectures whose q and k rows llama.cpp's converter interleaved


# GGUF's scalar value types, as struct formats
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass
class TensorInfo:
    """One tensor of a GGUF: its GGML type, its shape outermost first, and where its bytes start."""

    type: int
    shape: tuple[int, ...]
    offset: int  # from the start of the file

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        """Bytes one row (the innermost dimension) takes in the file: whole blocks of its type."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block_k, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(self.type)]
        return self.shape[-1] // block_k * block_bytes

    @property
    def nbytes(self) -> int:
        return self.numel // self.shape[-1] * self.row_bytes


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """A GGUF's scalar and string metadata (arrays skipped) and its tensors, by name."""
    with open(path, "rb") as stream:
        data = stream.read(1 << 20)
        pos = 0

        def take(n: int) -> bytes:
            nonlocal data, pos
            while pos + n > len(data):  # the header runs past what was read: read on
                more = stream.read(max(1 << 20, n))
                if not more:
                    raise ValueError(f"{path.name}: the file ends inside its GGUF header")
                data = data[pos:] + more
                pos = 0
            pos += n
            return data[pos - n:pos]

        def value(kind: int, keep: bool = True) -> Any:
            if kind in _SCALARS:
                return struct.unpack("<" + _SCALARS[kind], take(struct.calcsize(_SCALARS[kind])))[0]
            if kind == 8:
                text = take(struct.unpack("<Q", take(8))[0])
                return text.decode("utf-8", "replace") if keep else None
            if kind == 9:
                inner, count = struct.unpack("<IQ", take(12))
                for _ in range(count):
                    value(inner, keep=False)
                return None
            raise ValueError(f"{path.name}: unknown GGUF value type {kind}")

        magic, version, tensors, fields = struct.unpack("<4sIQQ", take(24))
        if magic != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file")
        if version < 2:
            raise ValueError(f"{path.name} is GGUF version {version}; Kev reads versions 2 and later")
        metadata: dict[str, Any] = {}
        for _ in range(fields):
            key = take(struct.unpack("<Q", take(8))[0]).decode()
            metadata[key] = value(struct.unpack("<I", take(4))[0])
        infos = []
        for _ in range(tensors):
            name = take(struct.unpack("<Q", take(8))[0]).decode()
            n_dims = struct.unpack("<I", take(4))[0]
            dims = struct.unpack(f"<{n_dims}Q", take(8 * n_dims))
            kind, offset = struct.unpack("<IQ", take(12))
            infos.append((name, kind, tuple(reversed(dims)), offset))  # GGUF lists the innermost dimension first
        header_end = stream.tell() - (len(data) - pos)
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-header_end // alignment) * alignment
    return metadata, {name: TensorInfo(kind, shape, start + offset) for name, kind, shape, offset in infos}


def tensor_bytes(path: Path) -> int:
    """The bytes of a GGUF's tensors, as its header lists them."""
    return sum(info.nbytes for info in read_header(path)[1].values())


class GgufFile:
    """The tensors of `path` by transformers' name (`get`); `keep_quantized` False dequantizes all."""

    def __init__(self, path: str | Path, config: Any, keep_quantized: bool) -> None:
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        self.path = Path(path)
        self.keep_quantized = keep_quantized
        metadata, self._tensors = read_header(self.path)
        self._file = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.architecture = str(metadata.get("general.architecture"))
        arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == self.architecture), None)
        if arch is None:
            raise ValueError(f"{self.path.name}: GGUF architecture {self.architecture!r} is not one gguf-py names")
        text = config.get_text_config()
        self._heads = int(text.num_attention_heads)
        self._kv_heads = int(getattr(text, "num_key_value_heads", None) or self._heads)
        self._names = get_tensor_name_map(arch, int(text.num_hidden_layers))
        self.kept: Counter[str] = Counter()  # block types kept as stored, tensors of each
        self.dequantized: Counter[str] = Counter()  # quantized types dequantized (not computed in place)

    def get(self, name: str) -> torch.Tensor | QuantTensor | None:
        """`name` (transformers', e.g. `model.layers.0.self_attn.q_proj.weight`), or None if absent."""
        base, _, suffix = name.rpartition(".")
        gguf_name = self._names.get_name(base)
        info = self._tensors.get(f"{gguf_name}.{suffix}") if gguf_name is not None else None
        if info is None:
            return None
        from gguf import GGMLQuantizationType, quants

        kind, shape = info.type, info.shape
        data = self._file[info.offset:info.offset + info.nbytes].reshape(-1, info.row_bytes)
        order = self._row_order(gguf_name, shape[0])
        if kind in FORMATS and len(shape) == 2 and self.keep_quantized:
            self.kept[FORMATS[kind].name] += 1
            quantized = QuantTensor(kind, shape[0], shape[1], data)
            return quantized.permuted_rows(order) if order is not None else quantized
        name = GGMLQuantizationType(kind).name
        if name in ("F32", "F16", "BF16"):  # the bytes are the values
            data = data.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[name])
        else:
            self.dequantized[name] += 1
        values = np.array(quants.dequantize(data, GGMLQuantizationType(kind)), dtype=np.float32).reshape(shape)
        if order is not None:
            values = values[order]
        return torch.from_numpy(np.ascontiguousarray(values))

    def _row_order(self, gguf_name: str, rows: int) -> np.ndarray | None:
        """transformers' order of a llama file's q or k rows (its `_reverse_permute_weights`)."""
        if self.architecture not in INTERLEAVED_QK:
            return None
        if gguf_name.endswith(".attn_q"):
            heads = self._heads
        elif gguf_name.endswith(".attn_k"):
            heads = self._kv_heads
        else:
            return None
        return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
