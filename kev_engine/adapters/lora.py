"""LoRA in the packed pass: each adapter's delta on its own rows only.

Where this sits: `model.forward`. Target linear layers of the base model are wrapped in
`MultiLoRALinear`: the base projection runs once over the whole pack, then each adapter's
`B(A(x)) * scaling` runs only on the rows (tokens) of the segments that use it — grouped by
adapter, never over tokens it does not own — and is added in place. Base-model questions pay
nothing. PEFT's own mixed batches route per *sample* (dim 0), which a [1, T] pack cannot use.
The products themselves are the platform's (`LoraRouter.products`): on a batch-invariant
platform a row's delta does not depend on how many rows of its adapter share the pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import AdapterError


@dataclass
class LoraWeights:
    """One adapter's weights for one linear module, in the adapter's own dtype."""

    lora_A: torch.Tensor  # [r, in_features]
    lora_B: torch.Tensor  # [out_features, r]
    scaling: float
    packed: Any = None  # A and B in a platform kernel's own layout, made once by its products


LoraProducts = Callable[[LoraWeights, torch.Tensor], torch.Tensor]
"""A platform's `B(A(x)) * scaling` for rows x [n, in] in the adapter's dtype → [n, out]."""
LoraRoutes: TypeAlias = "Sequence[tuple[LoraAdapter, slice | torch.Tensor]]"
"""Each adapter of a pass with its rows of the pack (`LoraRouter.routes`)."""


def torch_delta(weights: LoraWeights, x: torch.Tensor) -> torch.Tensor:
    """PEFT's own math, by torch's products (equal to a fixed-order product up to rounding)."""
    return F.linear(F.linear(x, weights.lora_A), weights.lora_B) * weights.scaling


@dataclass
class LoraAdapter:
    name: str
    path: str
    modules: dict[str, LoraWeights]  # base-model module name → weights

    @property
    def device(self) -> torch.device:
        return next(iter(self.modules.values())).lora_A.device

    def to(self, device: torch.device | str) -> None:
        for w in self.modules.values():
            w.lora_A, w.lora_B = w.lora_A.to(device), w.lora_B.to(device)

    def nbytes(self) -> int:
        return sum(w.lora_A.nbytes + w.lora_B.nbytes for w in self.modules.values())


def add_delta(out: torch.Tensor, x: torch.Tensor, rows: slice | torch.Tensor, weights: LoraWeights,
              products: LoraProducts) -> None:
    """out[rows] += B(A(x[rows])) * scaling, in place: PEFT's math on the token dimension, the
    adapter in its own dtype (cast in, cast back). out [T, out], x [T, in]."""
    delta = products(weights, x[rows].to(weights.lora_A.dtype))  # [n, out]
    if isinstance(rows, slice):
        out[rows] += delta.to(out.dtype)
    else:
        out.index_add_(0, rows, delta.to(out.dtype))


class LoraRouter:
    """Which rows of the current pack belong to which adapter; set for one forward at a time."""

    def __init__(self) -> None:
        self.routes: list[tuple[LoraAdapter, slice | torch.Tensor]] = []
        self.products: LoraProducts = torch_delta  # the platform's (`Platform.lora_products`)

    def set_routes(self, cu_seqlens: list[int], adapters: list[str | None], resident: dict[str, LoraAdapter]) -> None:
        """Group segments by adapter: contiguous rows become one slice, scattered ones an index."""
        ranges: dict[str, list[tuple[int, int]]] = {}
        for i, name in enumerate(adapters):
            if name is not None:
                ranges.setdefault(name, []).append((cu_seqlens[i], cu_seqlens[i + 1]))
        self.routes = []
        for name, spans in ranges.items():
            adapter = resident[name]
            merged = spans[0][0] if all(a == b for (_, b), (a, _) in zip(spans, spans[1:])) else None
            if merged is not None:
                self.routes.append((adapter, slice(merged, spans[-1][1])))
            else:
                rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(adapter.device)
                self.routes.append((adapter, rows))

    def clear(self) -> None:
        self.routes = []

    def __iter__(self) -> Iterator[tuple[LoraAdapter, slice | torch.Tensor]]:
        return iter(self.routes)


class MultiLoRALinear(nn.Module):
    """A base `nn.Linear` plus every adapter that targets it, applied per segment."""

    def __init__(self, base: nn.Linear, module_name: str, router: LoraRouter) -> None:
        super().__init__()
        self.base = base
        self.module_name = module_name
        self.router = router

    @property
    def weight(self) -> torch.Tensor:  # models that read `.weight` directly (tied heads, dtype probes)
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # [1, T, out]: the base projection once over the whole pack
        for adapter, rows in self.router:
            weights = adapter.modules.get(self.module_name)
            if weights is not None:  # else this adapter does not target this module
                add_delta(out[0], x[0], rows, weights, self.router.products)
        return out


def wrap_targets(model: nn.Module, module_names: list[str], router: LoraRouter) -> None:
    """Wrap each named Linear of `model` (once) so adapters can be routed through it."""
    for module_name in module_names:
        module = model.get_submodule(module_name)
        if isinstance(module, MultiLoRALinear):
            continue
        if not isinstance(module, nn.Linear):
            raise AdapterError(f"{module_name!r} is a {type(module).__name__}; LoRA routing wraps Linear layers only")
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MultiLoRALinear(module, module_name, router))
