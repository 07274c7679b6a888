"""Linear layers over few rows on CPU, computed as (W @ x.T).T.

Where this sits: installed on the model's plain `nn.Linear` layers when an `Engine` wraps a
float32 model on CPU (`model_setup.prepare_model`), removed when it closes.

Why: a decode pass multiplies each weight by a handful of rows (one per running question), and
MKL's float32 `x @ W.T` for 2-32 rows runs far below what the same dot products cost as the
tall, thin product `W @ x.T` (measured on the embedded model's shapes, 2-core AMD EPYC, MKL
2024.2, torch 2.13, per layer of q/k/v/o/gate/up/down: 2 rows 1.64 -> 0.73 ms, 4 rows
1.72 -> 0.77, 16 rows 1.81 -> 1.55, 64 rows 3.76 -> 3.61, 512 rows 24.2 -> 27.2). So layers
switch at `MAX_ROWS`; the output head (49152 x 576 there, the widest product of a step) gains at
every row count measured (16 rows 23.5 -> 16.3 ms, 512 rows 278 -> 233 ms), so it always does.
The values are the same dot products, equal to `F.linear` up to float32 summation order.

Only a plain `nn.Linear` whose `forward` nobody else replaced (accelerate's offload hooks do) is
changed, through an instance attribute; the class and every other model object are untouched.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 32  # rows per call up to which hidden layers use W @ x.T (see the module docstring)


def install(model: nn.Module) -> int:
    """Give the model's eligible Linear layers the few-rows product; returns how many were changed."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and _eligible(module):
            max_rows = None if module is head else MAX_ROWS
            module.forward = functools.partial(_forward, module, max_rows)  # type: ignore[method-assign]
            changed += 1
    return changed


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


def _forward(layer: nn.Linear, max_rows: int | None, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, as (W @ x.T).T when x has at most `max_rows` rows (None: any number)."""
    rows = x.reshape(-1, x.shape[-1])
    if max_rows is not None and rows.shape[0] > max_rows:
        return F.linear(x, layer.weight, layer.bias)
    out = torch.mm(layer.weight, rows.t()).t()  # [rows, out_features], a transposed view
    if layer.bias is not None:
        out = out + layer.bias
    return out.contiguous().view(*x.shape[:-1], out.shape[-1])
