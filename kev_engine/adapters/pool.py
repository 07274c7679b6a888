"""The adapter pool: which LoRA adapters are known, which are resident, which are in use.

`max_adapters` slots live on the model's device; when a new adapter needs a slot, the least
recently used *idle* one moves to the CPU (kept, not forgotten). An adapter used by an
in-flight request is pinned (refcount) and never evicted; a request whose adapter cannot get
a slot yet simply waits in the queue. Unloading an adapter in use takes effect when its last
request finishes; until then it is *draining*: new requests naming it fail at once, unloading
it again changes nothing, and its name cannot be loaded again.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter, OrderedDict
from pathlib import Path

import torch
from torch import nn

from ..errors import AdapterError, UnknownAdapterError
from .lora import LoraAdapter, LoraRouter, MultiLoRALinear, wrap_targets
from .peft_files import load_adapter

_versions = itertools.count(1)  # one per load, process-wide: a reload under the same name is a new adapter
# an adapter's name is a model id to clients (/v1/models, a URL path in DELETE /admin/adapters/NAME):
# letters, digits and . _ -, starting with a letter or digit, so it is always one path segment
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_name(name: object, reserved: tuple[str, ...] = ()) -> str:
    """An adapter name as every front end takes it: the pattern, and never a name that means
    something else here (the served model's own: an adapter under it would answer its requests)."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise AdapterError(f"adapter name {name!r} is not allowed; use {NAME_RULE}")
    if name in reserved:
        raise AdapterError(f"adapter name {name!r} is not allowed: it is the served model's own name; "
                           "give the adapter a name of its own")
    return name


class AdapterPool:
    def __init__(self, model: nn.Module, device: torch.device, max_adapters: int) -> None:
        if max_adapters < 1:
            raise ValueError(f"max_adapters={max_adapters} is not allowed; use an integer >= 1")
        self.model = model
        self.device = device
        self.max_adapters = max_adapters
        self.router = LoraRouter()
        self.known: dict[str, LoraAdapter] = {}
        self.resident: OrderedDict[str, None] = OrderedDict()  # LRU order: oldest first
        self.refs: Counter[str] = Counter()  # requests queued or running with it: keeps it loaded
        self.pinned: Counter[str] = Counter()  # requests running with it: keeps it resident
        self.unloading: set[str] = set()
        self.versions: dict[str, int] = {}
        self.evictions = 0
        self.restore_model()  # wrappers an engine dropped without close() left behind would route to ITS router

    @property
    def names(self) -> list[str]:
        return [n for n in self.known if n not in self.unloading]

    @property
    def draining(self) -> dict[str, int]:
        """Adapters unloaded while in use → the requests still using them."""
        return {name: self.refs[name] for name in self.unloading}

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """Load and validate from disk (slow; call outside the engine's forward lock)."""
        check_name(name)
        if name in self.unloading:
            raise AdapterError(f"adapter {name!r} is still draining: {self.refs[name]} request(s) from before its "
                               "unload still use it; load it again once they finish (Engine.wait_for_unload)")
        if name in self.known:
            raise AdapterError(f"adapter {name!r} is already loaded; unload it first")
        return load_adapter(name, path, self.model)

    def loaded_from(self, name: str, path: str | Path) -> bool:
        """True when `name` is already servable from the same folder (loading it again is a no-op);
        an error when `name` is taken by another folder: one name never silently means two adapters."""
        adapter = self.known.get(name)
        if adapter is None or name in self.unloading:
            return False
        if Path(adapter.path).resolve() == Path(path).expanduser().resolve():
            return True
        raise AdapterError(
            f"adapter {name!r} is already loaded from {adapter.path!r}; it cannot also name {str(path)!r}. "
            "Use another name, or unload_adapter() it first"
        )

    def install(self, adapter: LoraAdapter) -> None:
        """Make a read adapter servable: on a transformers model, wrap its target modules (under the
        forward lock); Kev's own model reads the router's routes itself."""
        if isinstance(self.model, nn.Module):
            wrap_targets(self.model, list(adapter.modules), self.router)
        self.unloading.discard(adapter.name)
        self.known[adapter.name] = adapter
        self.versions[adapter.name] = next(_versions)

    def prefix_key(self, name: str | None) -> tuple[str, int] | None:
        """What an adapter adds to a KV prefix key: its name AND the load it came from."""
        return None if name is None else (name, self.versions[name])

    def restore_model(self) -> None:
        """Put the model's original Linear layers back (closing: the model leaves clean; starting:
        it arrives clean)."""
        for module_name, module in list(self.model.named_modules()) if isinstance(self.model, nn.Module) else []:
            if isinstance(module, MultiLoRALinear):
                parent_name, _, child = module_name.rpartition(".")
                parent = self.model.get_submodule(parent_name) if parent_name else self.model
                setattr(parent, child, module.base)
        for adapter in self.known.values():
            adapter.to("cpu")
        self.resident.clear()

    def check(self, name: str | None) -> None:
        """Raise for an adapter name no request may use."""
        if name is not None and (name not in self.known or name in self.unloading):
            raise UnknownAdapterError(f"unknown adapter {name!r}; loaded: {self.names}")

    def ref(self, name: str | None) -> None:
        """A request naming `name` was queued: it stays loaded until the request ends."""
        self.check(name)
        if name is not None:
            self.refs[name] += 1

    def unref(self, name: str | None) -> None:
        if name is None:
            return
        self.refs[name] -= 1
        if self.refs[name] <= 0:
            del self.refs[name]
            if name in self.unloading:
                self._forget(name)

    def acquire(self, name: str | None) -> bool:
        """Pin `name` on the device for one running request; False if every slot is pinned."""
        if name is None:
            return True
        if name not in self.resident:
            if len(self.resident) >= self.max_adapters and not self._evict_one():
                return False
            self.known[name].to(self.device)
            self.resident[name] = None
        self.resident.move_to_end(name)
        self.pinned[name] += 1
        return True

    def release(self, name: str | None) -> None:
        if name is None:
            return
        self.pinned[name] -= 1
        if self.pinned[name] <= 0:
            del self.pinned[name]

    def unload(self, name: str) -> None:
        """Forget `name` now, or when the last request using it ends; new requests fail at once.
        A name already draining stays so (the first unload is still under way)."""
        if name in self.unloading:
            return
        self.check(name)
        if self.refs[name]:
            self.unloading.add(name)
        else:
            self._forget(name)

    def _evict_one(self) -> bool:
        for name in self.resident:  # oldest first
            if not self.pinned[name]:
                self.known[name].to("cpu")
                del self.resident[name]
                self.evictions += 1
                return True
        return False

    def _forget(self, name: str) -> None:
        self.resident.pop(name, None)
        self.unloading.discard(name)
        self.known.pop(name, None)
        self.versions.pop(name, None)

    def resident_map(self) -> dict[str, LoraAdapter]:
        return {n: self.known[n] for n in self.resident}
