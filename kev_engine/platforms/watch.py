"""What a platform's own pass assumes of the model's modules, checked before every pass it takes.

Where this sits: the CPU platform's direct passes (a decoder layer as one function over its
parts, `cpu/layer_forward.py`; a model's pass of Kev's calls alone, `cpu/model_forward.py`)
and CUDA's decode graphs (`cuda/graphs.py`) build one when they are installed, first fit or
capture, and ask it before each pass.

Why: those passes call the functions a module's forward ends in without `nn.Module.__call__`, so
they are right only while every module they skip is still the module installed, runs the forward
installed, and has no forward hooks: a hook registered while the engine runs (capturing
activations, steering a layer) must run, so the pass then goes through the modules' own calls,
as it does where a hook was there first. Asked attribute by attribute for each part of thirty
layers, that is a Python loop every decode step; here the dictionaries that hold each answer are
taken once, and a check compares their entries by identity and finds the hook tables where they
hang (a module's `__dict__`, torch's module globals) to test them for emptiness, in C loops
(`map`, `any`). A `_modules` or `_parameters` dictionary is watched where it hangs too: code that
replaces one wholesale (or a hook table: `module._forward_hooks = OrderedDict()`) is seen like
code that writes into it.
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
        self._hook_holders: list[dict[str, Any]] = []  # where a hook table hangs, read again at each check
        self._hook_names: list[str] = []
        self._tables: set[tuple[int, str]] = set()  # (id of a holder, name) whose table is watched already

    def entry(self, place: dict[str, Any], key: str, held: Any) -> Watch:
        """`place[key]` must stay `held` (None: absent)."""
        self._places.append(place)
        self._keys.append(key)
        self._held.append(held)
        return self

    def table(self, module: nn.Module, name: str) -> dict[Any, Any]:
        """`module`'s dictionary `name` (`_modules`, `_parameters`, `_buffers`), which must stay
        the one it hangs there."""
        found: dict[Any, Any] = module.__dict__[name]
        if (id(module.__dict__), name) not in self._tables:
            self._tables.add((id(module.__dict__), name))
            self.entry(module.__dict__, name, found)
        return found

    def unhooked(self, module: nn.Module) -> Watch:
        """`module` must have no forward hooks and no forward pre-hooks (with or without kwargs:
        each is in these two tables). Backward hooks never change a forward's values."""
        self._hook_holders += [module.__dict__, module.__dict__]
        self._hook_names += ["_forward_hooks", "_forward_pre_hooks"]
        return self

    def no_global_hooks(self) -> Watch:
        """No forward hook registered for every module (`register_module_forward_hook`)."""
        self._hook_holders += [vars(torch_module), vars(torch_module)]
        self._hook_names += ["_global_forward_hooks", "_global_forward_pre_hooks"]
        return self

    def part(self, owner: nn.Module, name: str) -> Watch:
        """`owner.<name>` must stay the module it is now, with the forward it has now (an instance
        attribute, or none: the class's), and gain no hooks."""
        module = owner._modules[name]
        assert module is not None, f"no part {name!r}"
        self.entry(self.table(owner, "_modules"), name, module)
        return self.entry(module.__dict__, "forward", module.__dict__.get("forward")).unhooked(module)

    def extend(self, other: Watch) -> Watch:
        """Everything `other` watches too."""
        self._places += other._places
        self._keys += other._keys
        self._held += other._held
        self._hook_holders += other._hook_holders
        self._hook_names += other._hook_names
        self._tables |= other._tables
        return self

    def holds(self) -> bool:
        """Whether nothing watched has changed since it was added."""
        return (not any(map(dict.get, self._hook_holders, self._hook_names))
                and all(map(operator.is_, map(dict.get, self._places, self._keys), self._held)))
