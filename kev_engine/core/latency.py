"""Latency histograms an operator reads: how long passes take and how long requests wait to start.

Why: a pass budget is a promise about time (`Engine(pass_time_ms=...)`); these show whether it is
kept on this machine under this load. Snapshots hold cumulative buckets in Prometheus' form (`le`:
at most this many seconds), so `kev serve`'s /metrics hands them to prometheus_client as they are,
and several engines' add up (`merged`).
"""

from __future__ import annotations

import bisect
from typing import Any

BOUNDS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Counts of observed seconds by upper bound, with their count and sum."""

    def __init__(self, bounds: tuple[float, ...] = BOUNDS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.count = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds
        self.max = max(self.max, seconds)

    def add(self, snapshot: dict[str, Any]) -> None:
        """Count in another histogram's `snapshot` (same bounds): several servers' as one."""
        previous = 0
        for i, (_, cumulative) in enumerate(snapshot["buckets"]):
            self.counts[i] += cumulative - previous
            previous = cumulative
        self.count += snapshot["count"]
        self.sum += snapshot["sum"]
        self.max = max(self.max, snapshot["max"])

    def snapshot(self) -> dict[str, Any]:
        """{"count", "sum", "max", "buckets": [[le, cumulative count], ..., ["+Inf", count]]}."""
        buckets: list[list[Any]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            buckets.append([bound, running])
        buckets.append(["+Inf", self.count])
        return {"count": self.count, "sum": self.sum, "max": self.max, "buckets": buckets}


def merged(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot holding several engines' (Ray replicas with the same bounds): counts added."""
    total = Histogram(tuple(bound for bound, _ in snapshots[0]["buckets"][:-1]))
    for snapshot in snapshots:
        total.add(snapshot)
    return total.snapshot()

