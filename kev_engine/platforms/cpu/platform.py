"""The CPU platform: Kev's compiled kernels, batch-invariant where they cover the model.

Kev's own model computes with the platform's ops (`ops`): batch-invariant (the default where the
kernels load, in float32 and bfloat16) every product by the packed kernel, each layer as one
kernel call, and every attention row by the exact kernel (`exact.ExactBackend`); otherwise the
few-row product for decode and the compiled decode kernel (`fast.FastBackend`), or
torch's ops where the kernels are off or failed to build.

A transformers model on the fallback path gets the same kernels installed on its modules: every
`nn.Linear` (the output head too) by the packed product (`exact_linear`), rotary cos/sin from a
table (`rotary_table`), the MLP's `silu(gate) * up` and RMSNorm by kernels (`inplace`); or the
few-row product (`rows_linear`) and elementwise work in place.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ...models.ops import Ops
from .. import inplace
from ..base import AttentionBackend, Platform
from ..torch_ops import TorchBackend
from . import exact_linear, rotary_table, rows_linear
from .exact import ExactBackend
from .fast import FastBackend
from .kernels import Kernels
from .ops import ExactOps, FastOps, packed_delta

ROW_BLOCK = 96  # csrc/linear.cpp's kRowBlock: the rows whose products read each weight once


class CpuPlatform(Platform):
    name = "cpu"

    def __init__(self, device: torch.device, kernels: Kernels | None, batch_invariant: bool) -> None:
        attention: AttentionBackend
        if batch_invariant:
            assert kernels is not None, "the batch-invariant CPU path runs on Kev's kernels (why_not says so)"
            attention = ExactBackend(kernels)
        else:
            attention = FastBackend(kernels) if kernels is not None else TorchBackend()
        super().__init__(device, attention, batch_invariant)
        self.kernels = kernels
        if batch_invariant:
            self.lora_products = functools.partial(packed_delta, kernels)  # the fallback's LoRA layers

    def install(self, model: nn.Module) -> list[str]:
        if self.batch_invariant:
            assert self.kernels is not None
            exact_linear.install(model, self.kernels)  # every Linear: one summation order at any row count
            left = rotary_table.install(model)
            left += inplace.install(model, self.kernels.silu_mul, self.kernels.rms_norm)
            return left
        rows_linear.install(model, self.kernels.rows_linear if self.kernels is not None else None)  # few-row products
        inplace.install(model)  # Llama-style MLPs and RMSNorms: elementwise work in place
        return []

    def rows_alike(self, rows: int, dtype: torch.dtype) -> int:
        """`csrc/linear.cpp`'s shapes: a bf16 pass on AMX of at most 16 rows is one decode tile that
        streams each weight once (a 17th row moves every product to 32-row tiles: a 0.7B model's
        16-row step took 55 ms, 17 rows 64 ms); past that, tiles of 32 rows, each re-reading the
        weights from cache. The other paths take rows in blocks of 96, each block reading the
        weights once, in register tiles of 6 (compute only). Torch's kernels: no promise."""
        if self.kernels is None or not self.batch_invariant:
            return rows
        if dtype == torch.bfloat16 and self.kernels.bf16_path.path == "amx":
            return 16 if rows <= 16 else -(-rows // 32) * 32
        return -(-rows // ROW_BLOCK) * ROW_BLOCK

    def use_threads(self, threads: int) -> None:
        """Kev's kernels on `threads` threads (csrc/pool.h: tasks to whichever is free)."""
        if self.kernels is not None:
            self.kernels.set_threads(threads)

    def enter_pass_thread(self) -> None:
        """On the batch-invariant path every product, norm and attention is Kev's, on Kev's threads;
        torch's own ops of a pass (the embedding, sampling) are small, and on torch's threads each
        would end in a barrier that waits for a thread whose core another program took: they run
        on the pass's thread alone (this thread's OpenMP count, not the process's)."""
        if self.batch_invariant and self.kernels is not None:
            torch.get_num_threads()  # torch's lazy per-thread setup first, so it cannot undo this
            self.kernels.serial_torch_here()

    def ops(self) -> Ops:
        """Kev's kernels: batch-invariant (`ExactOps`), or fast (`FastOps`); torch's without them."""
        if self.kernels is None:
            return Ops()
        return ExactOps(self.kernels) if self.batch_invariant else FastOps(self.kernels)


def why_not_invariant(model: nn.Module, kernels: Kernels | None, parameter: torch.Tensor) -> str | None:
    """Why this CPU model cannot run batch-invariant, or None when it can."""
    if kernels is None:
        return "Kev's compiled CPU kernels are not in use (cpu_kernels='torch', or they could not be built)"
    if parameter.dtype not in exact_linear.DTYPES:
        return f"the model is in {parameter.dtype}; the batch-invariant kernels compute float32 and bfloat16"
    left = exact_linear.uncovered(model)
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        return f"these Linear layers cannot take Kev's packed product (other dtype, device or forward): {shown}"
    return None
