"""Which adapters a replica's engine holds, and which requests hold them (no Ray needed here).

Serve's multiplexing decides what a replica should hold: an LRU of `max_adapters_per_replica`
that calls `hold(name)` on a miss and `evict(name)` (through `_Held.__del__`) when it drops one.
The engine must not lose an adapter a request is still using, and a request for an adapter
the LRU just dropped must not find it half gone. So:

- a request `acquire`s each adapter it names right after Serve hands it over (no await in
  between) and `release`s them when its response has ended;
- `evict` unloads from the engine at once when nobody uses the adapter, else marks it and the
  last `release` unloads it;
- `hold` of a marked adapter takes the mark back: it never left the engine, nothing is loaded.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any


class _Held:
    """What Serve caches per adapter; Serve calls `__del__` when its LRU drops it (and the
    garbage collector may call it once more later, hence the flag)."""

    def __init__(self, leases: AdapterLeases, name: str) -> None:
        self.leases, self.name, self.evicted = leases, name, False

    def __del__(self) -> None:
        if not self.evicted:
            self.evicted = True
            self.leases.evict(self.name)


class AdapterLeases:
    def __init__(self, engine: Any, catalog: dict[str, str]) -> None:
        self.engine, self.catalog = engine, dict(catalog)
        self.loads: Counter[str] = Counter()  # adapter → times it was read from disk here
        self._in_use: Counter[str] = Counter()
        self._evicted: set[str] = set()  # dropped by the LRU, still in use: unloaded by the last release
        self._lock = threading.Lock()  # `evict` runs on Serve's executor thread, the rest on the event loop

    async def hold(self, name: str) -> _Held:
        """Make `name` servable (Serve's loader on an LRU miss)."""
        with self._lock:
            if name in self._evicted:  # dropped but still in use: it never left the engine
                self._evicted.discard(name)
                return _Held(self, name)
        await asyncio.to_thread(self.engine.load_adapter, name, self.catalog[name])
        self.loads[name] += 1
        return _Held(self, name)

    def acquire(self, name: str) -> None:
        with self._lock:
            self._in_use[name] += 1

    def release(self, names: list[str]) -> None:
        with self._lock:
            self._in_use.subtract(names)
            idle = [n for n in set(names) if self._in_use[n] <= 0 and n in self._evicted]
            self._evicted.difference_update(idle)
        for name in idle:
            self._unload(name)

    def evict(self, name: str) -> None:
        """The LRU dropped `name`: unload it now if idle, else when its last request ends."""
        with self._lock:
            if self._in_use[name] > 0:
                self._evicted.add(name)
                return
        self._unload(name)

    def _unload(self, name: str) -> None:
        if not self.engine.closed:  # at teardown the engine may be gone first: nothing to unload
            self.engine.unload_adapter(name)
