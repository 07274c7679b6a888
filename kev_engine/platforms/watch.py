"""What a platform's own pass assumes of the model's modules, checked before every pass it takes.

Where this sits: the CPU platform's direct passes (a decoder layer as one function over its
parts, `cpu/layer_forward.py`; a model's pass of Kev's calls alone, `cpu/model_forward.py`)
build one when they are installed or first fit, and ask it before each pass.

Why: those passes call the functions a module's forward ends in without `nn.Module.__call__`, so
they are right only while every module they skip is still the module installed, runs the forward
installed, and has no forward hooks: a hook registered while the engine runs (capturing
activations, steering a layer) must run, so the pass then goes through the modules' own calls,
as it does where a hook was there first. Asking that attribute by attribute for each part of
thirty layers costs a few tenths of a millisecond a decode step; here the dictionaries that hold
each answer are taken once, and a check compares their entries by identity and their hook
tables by emptiness in C loops (`map`, `any`): tens of microseconds.

The dictionaries a module keeps (`_modules`, `_parameters`, `__dict__`, its hook tables) and
torch's global hook tables stay the same objects for the module's life: registering a hook or
assigning a part writes into them, which is what a check reads.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module


class Watch:
    """Entries that must still hold what they held when added, and hook tables that must be empty."""

    def __init__(self) -> None:
        self._places: list[dict[str, Any]] = []
        self._keys: list[str] = []
        self._held: list[Any] = []
        self._hooks: list[dict[Any, Any]] = []

    def entry(self, place: dict[str, Any], key: str, held: Any) -> Watch:
        """`place[key]` must stay `held` (None: absent)."""
        self._places.append(place)
        self._keys.append(key)
        self._held.append(held)
        return self

    def unhooked(self, module: nn.Module) -> Watch:
        """`module` must have no forward hooks and no forward pre-hooks (with or without kwargs:
        each is in these two tables). Backward hooks never change a forward's values."""
        self._hooks += [module._forward_hooks, module._forward_pre_hooks]
        return self

    def no_global_hooks(self) -> Watch:
        """No forward hook registered for every module (`register_module_forward_hook`)."""
        self._hooks += [torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks]
        return self

    def part(self, owner: nn.Module, name: str) -> Watch:
        """`owner.<name>` must stay the module it is now, with the forward it has now (an instance
        attribute, or none: the class's), and gain no hooks."""
        module = owner._modules[name]
        assert module is not None, f"no part {name!r}"
        return self.entry(owner._modules, name, module).entry(module.__dict__, "forward",
                                                              module.__dict__.get("forward")).unhooked(module)

    def extend(self, other: Watch) -> Watch:
        """Everything `other` watches too."""
        self._places += other._places
        self._keys += other._keys
        self._held += other._held
        self._hooks += other._hooks
        return self

    def holds(self) -> bool:
        """Whether nothing watched has changed since it was added."""
        return not any(self._hooks) and all(map(operator.is_, map(dict.get, self._places, self._keys), self._held))
