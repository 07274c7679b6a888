"""The CPU's last-level cache, as Linux reports it: where `weights="auto"` draws its line.

Why: a decode step reads every weight once. Weights that fit in the last-level cache are read
from it at cache speed, and decoding a GGUF's quantized blocks costs more than the bytes it
saves; weights that do not fit stream from memory every step, and the file's blocks are 2-6x
fewer bytes than the same weights in bf16 or fp32. Measured on a 2-core Xeon with 300 MB of L3
(docs/benchmarks.md, "Weights as they ship"): the embedded model in bf16 (270 MB) ran faster
dense, in fp32 (540 MB) faster as stored.
"""

from __future__ import annotations

from pathlib import Path

CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_bytes(root: Path = CACHES) -> int | None:
    """The size of the highest-level cache cpu0 has, or None where the system does not say."""
    best: tuple[int, int] | None = None
    for index in root.glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
            kind = (index / "type").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not text:
            continue
        size = int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text)
        if best is None or level > best[0]:
            best = (level, size)
    return best[1] if best is not None else None
