"""Linear layers over few rows on CPU: Kev's compiled product, else (W @ x.T).T.

Where this sits: installed on the model's plain `nn.Linear` layers when an `Engine` wraps a
float32 model on CPU (`CpuPlatform.install`), removed when it closes.

This is the non-invariant path (`Engine(batch_invariant=False)`, or no exact kernels): a row's
products depend on how many rows share the call. The batch-invariant path is `exact_linear`.

With the compiled kernels (`kernels`, modes "auto"/"compiled"), calls of up to
`KERNEL_ROWS` rows go to `rows_linear` (csrc/rows_linear.cpp), faster than MKL up to that
count, and each row's result is then independent of the other rows. Larger calls (prefill) keep
MKL as below.

Why W @ x.T without the kernel: a decode pass multiplies each weight by a handful of rows (one
per running question), and for some row counts MKL's float32 `x @ W.T` runs far slower than the
same dot products as the tall, thin product `W @ x.T`. On the embedded model's shapes only 2-5
rows gained reliably for hidden layers, so they switch up to `MAX_ROWS` (4); the output head (the
widest product of a step) was never slower, so it always does. The timings, with their machine,
are in docs/benchmarks.md ("Few-row products"). The values are the same dot products, equal to
`F.linear` up to float32 summation order.

Only a plain `nn.Linear` whose `forward` nobody else replaced (accelerate's offload hooks do) is
changed, through an instance attribute; the class and every other model object are untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

RowsLinear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # kernels.Kernels.rows_linear

MAX_ROWS = 4  # rows per call up to which hidden layers use W @ x.T (see the module docstring)
KERNEL_ROWS = 32  # rows per call up to which the compiled kernel beat MKL on every layer (rows_linear.cpp)


def install(model: nn.Module, kernel: RowsLinear | None = None) -> None:
    """Give the model's eligible Linear layers the few-rows product (`kernel`: the compiled one)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    for module in model.modules():
        if isinstance(module, nn.Linear) and _eligible(module):
            max_rows = None if module is head else MAX_ROWS
            own_kernel = kernel if module.in_features % 8 == 0 else None  # the kernel reads K in 8s
            module.forward = functools.partial(_forward, module, max_rows, own_kernel)  # type: ignore[method-assign]


def uninstall(model: nn.Module) -> None:
    """Give every layer back its class's `forward`."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and _is_ours(module.__dict__.get("forward")):
            del module.forward


def _eligible(module: nn.Linear) -> bool:
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
    )


def _is_ours(forward: Any) -> bool:
    return isinstance(forward, functools.partial) and forward.func is _forward


def _forward(layer: nn.Linear, max_rows: int | None, kernel: RowsLinear | None, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`: the kernel's product up to KERNEL_ROWS rows, else (W @ x.T).T when x has at most
    `max_rows` rows (None: any number), else F.linear."""
    rows = x.reshape(-1, x.shape[-1])
    if kernel is not None and rows.shape[0] <= KERNEL_ROWS and layer.weight.is_contiguous():
        product = kernel(rows, layer.weight)
        if layer.bias is not None:
            product += layer.bias
        return product.view(*x.shape[:-1], product.shape[-1])
    if max_rows is not None and rows.shape[0] > max_rows:
        return F.linear(x, layer.weight, layer.bias)
    out = torch.mm(layer.weight, rows.t()).t()  # [rows, out_features], a transposed view
    if layer.bias is not None:
        out = out + layer.bias
    return out.contiguous().view(*x.shape[:-1], out.shape[-1])
