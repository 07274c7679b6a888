"""Batch invariance: whether this engine computes every answer bitwise the same packed as alone.

Packed output equals solo output *exactly* when every reduction in a pass has one order that does
not depend on what else is in the pass. On CPU, in float32 and bfloat16, with Kev's compiled
kernels (`cpu.kernels`), the engine runs that path (`cpu.platform`):

- every `nn.Linear`, the output head and LoRA deltas: `cpu.exact_linear` (csrc/linear.cpp), each
  output summed in an order fixed by K alone, for 1 row or 5,000 (bf16: fp32 accumulation, AMX
  tiles or AVX512-BF16 where the CPU has them);
- attention: `paged_attention` (csrc/attention.cpp) for every row of a pass, prefill and decode
  alike, each walking its own positions in chunks of 32 in order — the same whether its prefix
  was shared in this pass, cached from an earlier call or computed alone, and whatever the
  chunking of its prompt (`max_batch_tokens`) or a preemption's recompute;
- elementwise work that torch would finish in a scalar loop at a size-dependent place: rotary
  cos/sin from a table (`cpu.rotary_table`), the MLP's silu(gate) * up and RMSNorm by kernels
  (`inplace`; the norm's squares summed in one order fixed by the width);
- residuals, sampling: per row already (tested, not assumed: tests/test_invariance.py).

On CUDA (`cuda.invariant`, checked on a GPU by `make gpu-check`): Linear products and RMSNorms by
fixed-order Triton kernels, attention by torch's varlen_attn with `num_splits=1`.

`Engine(batch_invariant=False)` restores torch's BLAS and attention kernels (answers equal up to
rounding only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("kev")


def decide(wanted: bool | None, why_not: Callable[[], str | None], quiet: bool) -> bool:
    """The engine's choice given the platform's reason against (`why_not()`, None: it can), asked
    only when invariance is wanted or left to the platform. `wanted` True raises
    when impossible; None says why not on the "kev" logger (`quiet`: at info level, for kernels
    turned off on purpose or a device with no invariant path at all)."""
    if wanted is not None and not isinstance(wanted, bool):
        raise TypeError(f"batch_invariant={wanted!r} is not allowed; use True, False or None")
    if wanted is False:
        return False
    reason = why_not()
    if reason is None:
        return True
    if wanted:
        raise ValueError(f"batch_invariant=True cannot be honoured: {reason}")
    (log.info if quiet else log.warning)("Kev: not batch-invariant: %s; packed answers equal alone up to rounding",
                                        reason)
    return False
