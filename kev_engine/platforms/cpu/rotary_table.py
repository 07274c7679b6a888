"""Rotary embeddings from a table: each position's cos/sin computed once, the same in every pass.

Where this sits: installed on the model's rotary-embedding module (`model.model.rotary_emb`) by
the CPU platform on the batch-invariant path (`cpu.platform`), removed when the engine closes.

Why: the module computes cos/sin for every position of the pass with torch's elementwise loops,
which finish each thread's share of the flattened tensor with a scalar loop whose cos() may differ
from the vector one in the last bit — and which positions fall there depends on the pass's size.
Here the module's own forward runs once per block of `CHUNK` positions (the same call whenever a
block is first needed) and a pass looks its positions up: a position's cos/sin no longer depend
on what else is in the pass. Exact copies of what the module computes, so answers do not change.

Rope types whose frequencies depend on the longest sequence in a batch ("dynamic", "longrope")
cannot be packed at all, and are refused before (`model.rotary.check`).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ...model.rotary import rotary_modules

CHUNK = 1024  # positions computed per call of the module's own forward


def tabled(module: nn.Module) -> bool:
    """Whether `module`'s forward can be served from a table: forward(x, position_ids) -> (cos, sin)."""
    try:
        names = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False
    return names == ["self", "x", "position_ids"] and "forward" not in module.__dict__


def install(model: nn.Module) -> list[str]:
    """Serve every eligible rotary module from a table; return the names of those left as they are."""
    left = []
    rotary = {id(m) for m in rotary_modules(model)}
    for name, module in model.named_modules():
        if id(module) in rotary:
            if tabled(module):
                module.forward = functools.partial(_forward, module, _Table(module))  # type: ignore[method-assign]
            else:
                left.append(name or type(module).__name__)
    return left


def uninstall(model: nn.Module) -> None:
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func is _forward:
            del module.forward


class _Table:
    """cos/sin [positions, dim] for one module, per (dtype, device), grown CHUNK positions at a time."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def upto(self, count: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (dtype, device)
        cos, sin = self.tables.get(key, (None, None))
        have = 0 if cos is None else cos.shape[0]
        if have >= count:
            return cos, sin  # type: ignore[return-value]
        probe = torch.empty(0, dtype=dtype, device=device)  # the forward reads only its dtype and device
        parts_cos, parts_sin = ([cos] if cos is not None else []), ([sin] if sin is not None else [])
        for start in range(have, count, CHUNK):
            positions = torch.arange(start, start + CHUNK, device=device)[None]  # [1, CHUNK]
            c, s = type(self.module).forward(self.module, probe, positions)  # [1, CHUNK, dim] each
            parts_cos.append(c[0])
            parts_sin.append(s[0])
        cos, sin = torch.cat(parts_cos), torch.cat(parts_sin)
        self.tables[key] = (cos, sin)
        return cos, sin


def _forward(module: nn.Module, table: _Table, x: torch.Tensor, position_ids: torch.Tensor):
    """cos, sin [batch, seq, dim] for `position_ids` [batch, seq], looked up."""
    flat = position_ids.reshape(-1)
    cos, sin = table.upto(int(flat.max()) + 1, x.dtype, x.device)
    shape = (*position_ids.shape, cos.shape[-1])
    return cos.index_select(0, flat).view(shape), sin.index_select(0, flat).view(shape)
