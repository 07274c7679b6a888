"""Batch invariance: whether this engine computes every answer bitwise the same packed as alone.

Packed output equals solo output *exactly* when every reduction in a pass has one order that does
not depend on what else is in the pass. On CPU, in float32 and bfloat16, with Kev's compiled
kernels (`kernels.py`), the engine runs that path:

- every `nn.Linear`, the output head and LoRA deltas: `exact_linear` (csrc/linear.cpp), each
  output summed in an order fixed by K alone, for 1 row or 5,000 (bf16: fp32 accumulation, AMX
  tiles or AVX512-BF16 where the CPU has them);
- attention: `paged_attention` (csrc/attention.cpp) for every row of a pass, prefill and decode
  alike, each walking its own positions in chunks of 32 in order — the same whether its prefix
  was shared in this pass, cached from an earlier call or computed alone, and whatever the
  chunking of its prompt (`max_batch_tokens`) or a preemption's recompute;
- elementwise work that torch would finish in a scalar loop at a size-dependent place: rotary
  cos/sin from a table (`rotary_table`), the MLP's silu(gate) * up by a kernel (`inplace`);
- norms, residuals, sampling: per row already (tested, not assumed: tests/test_invariance.py).

On CUDA (`backends.cuda_invariant`, not yet run on a GPU in this project): Linear products and
RMSNorms by fixed-order Triton kernels, attention by torch's varlen_attn with `num_splits=1`.

`Engine(batch_invariant=False)` restores torch's BLAS and attention kernels (answers equal up to
rounding only) — the control that shows the invariance tests can fail.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import exact_linear

log = logging.getLogger("kev")


def why_not(model: Any, kernels: Any, parameter: torch.Tensor, paged: Any = None) -> str | None:
    """Why this model cannot run batch-invariant here, or None when it can (`paged`: a CUDA
    engine's attention kernel, `backends.cuda`)."""
    if paged is not None or parameter.device.type == "cuda":  # the paged CUDA attention's engine
        from .backends import cuda_invariant

        return cuda_invariant.why_not(model, paged)
    if parameter.device.type != "cpu":
        return f"the model is on {parameter.device}; Kev's batch-invariant kernels run on CPU"
    if kernels is None:
        return "Kev's compiled CPU kernels are not in use (decode_kernel='torch', or they could not be built)"
    if parameter.dtype not in exact_linear.DTYPES:
        return f"the model is in {parameter.dtype}; the batch-invariant kernels compute float32 and bfloat16"
    left = exact_linear.uncovered(model)
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        return f"these Linear layers cannot take Kev's packed product (other dtype, device or forward): {shown}"
    return None


def exact_or_why(wanted: bool | None, model: Any, kernels: Any, parameter: torch.Tensor, paged: Any = None) -> bool:
    """The engine's choice: `wanted` True raises when impossible; None says why not on the "kev" logger."""
    if wanted is not None and not isinstance(wanted, bool):
        raise TypeError(f"batch_invariant={wanted!r} is not allowed; use True, False or None")
    if wanted is False:
        return False
    reason = why_not(model, kernels, parameter, paged)
    if reason is None:
        return True
    if wanted:
        raise ValueError(f"batch_invariant=True cannot be honoured: {reason}")
    # kernels turned off on purpose, or a device with no invariant path at all
    quiet = parameter.device.type not in ("cpu", "cuda") or (parameter.device.type == "cpu" and kernels is None)
    (log.info if quiet else log.warning)("Kev: not batch-invariant: %s; packed answers equal alone up to rounding",
                                        reason)
    return False
