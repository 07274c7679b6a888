"""GET /metrics: the server's own counters plus the engine's stats, exposed by `prometheus_client`.

The numbers already live in the server (`Metrics`) and the engine (`Engine.stats()`), so a custom
collector turns one snapshot of each into metric families when /metrics is read: no global
registry, a registry per scrape, and a Ray fleet's snapshots are summed first (`Metrics.merged`,
`fleet_stats`) and then exposed the same way. Names follow Prometheus conventions (`_total`
counters, `_seconds` histograms).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kev_engine import Histogram, merged_histograms

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ENGINE_COUNTERS = {  # engine stat → (metric, help)
    "requests": ("kev_requests_total", "Questions the engine took (a prompt counts once, whatever its n)."),
    "forward_passes": ("kev_forward_passes_total", "Packed forward passes run."),
    "prefill_passes": ("kev_prefill_passes_total", "Passes that computed prompt tokens (decode rows may ride along)."),
    "decode_steps": ("kev_decode_steps_total", "Passes of decode rows alone; with the prefill passes, every pass."),
    "pass_slices": ("kev_pass_pauses_total", "Times a pass paused between its layers for other passes to run."),
    "paused_seconds": ("kev_pass_paused_seconds_total", "Time passes spent paused while other passes ran."),
    "prompt_tokens": ("kev_prompt_tokens_total", "Prompt tokens admitted."),
    "generated_tokens": ("kev_generated_tokens_total", "Tokens generated."),
    "draft_tokens": ("kev_draft_tokens_total", "Draft tokens verified in packed passes (speculative decoding)."),
    "draft_accepted_tokens": ("kev_draft_accepted_tokens_total", "Of the draft tokens, those the answers took."),
    "draft_seconds": ("kev_draft_model_seconds_total", "Time a draft model (speculative='model') spent drafting."),
    "prefix_hit_tokens": ("kev_prefix_hit_tokens_total", "Prompt tokens whose KV was reused from a shared prefix."),
    "adapter_evictions": ("kev_adapter_evictions_total", "Adapters evicted from the GPU/CPU slots."),
    "preemptions": ("kev_preemptions_total", "Requests preempted for KV memory."),
    "cancelled": ("kev_cancelled_total", "Requests cancelled before finishing (disconnects, timeouts)."),
    "grammar_cache_hits": ("kev_grammar_cache_hits_total", "Constraints served from the grammar cache."),
}
ENGINE_GAUGES = {
    "running": ("kev_running_requests", "Requests holding KV now."),
    "waiting": ("kev_waiting_requests", "Requests queued in the engine."),
    "kv_cache_bytes": ("kev_kv_cache_bytes", "KV memory in use."),
    "kv_cache_budget_bytes": ("kev_kv_cache_budget_bytes", "KV memory budget."),
    "kv_cached_prefix_bytes": ("kev_kv_cached_prefix_bytes", "KV kept for reuse (LRU prefix cache)."),
    "grammar_cache_bytes": ("kev_grammar_cache_bytes", "Compiled grammars kept for reuse (LRU, bounded)."),
}
ENGINE_HISTOGRAMS = {  # engine stat (a latency.Histogram snapshot) → (metric, help)
    "pass_seconds": ("kev_pass_duration_seconds", "Duration of each packed forward pass (target: pass_time_ms)."),
    "queue_seconds": ("kev_queue_delay_seconds", "Time from a request's submission to its first pass."),
}


class Metrics:
    """Counters the HTTP layer owns: requests by endpoint and status, latency, queue depth."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.latency = Histogram(LATENCY_BUCKETS_S)
        self.queued = 0  # questions accepted by the server and not answered yet

    def observe(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1
            if seconds is not None:
                self.latency.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        """The counts as plain data, to add up several servers' (Ray replicas) in one /metrics."""
        with self._lock:
            return {"requests": list(self.requests.items()), "latency": self.latency.snapshot(),
                    "queued": self.queued}

    @classmethod
    def merged(cls, snapshots: list[dict[str, Any]]) -> Metrics:
        """One Metrics holding the sum of `snapshot()`s: what a fleet of replicas has served."""
        total = cls()
        for snap in snapshots:
            for key, count in snap["requests"]:
                total.requests[tuple(key)] += count  # type: ignore[index]
            total.latency.add(snap["latency"])
            total.queued += snap["queued"]
        return total

    def render(self, engine_stats: dict[str, Any] | None, compiling: int | None = None) -> bytes:
        """The exposition text; `compiling`: grammars the server is compiling or about to (left out if None)."""
        registry = CollectorRegistry(auto_describe=False)  # this scrape's, never the process-wide one
        registry.register(Snapshot(self.snapshot(), engine_stats, compiling))
        return generate_latest(registry)


class Snapshot(Collector):
    """One scrape's numbers as metric families: a server's `Metrics.snapshot()`, an engine's
    `stats()` (None before the model has loaded) and the grammars compiling (None: not shown)."""

    def __init__(self, server: dict[str, Any], engine_stats: dict[str, Any] | None, compiling: int | None) -> None:
        self.server, self.engine_stats, self.compiling = server, engine_stats, compiling

    def collect(self) -> Iterator[Metric]:
        http = CounterMetricFamily("kev_http_requests_total", "HTTP requests by endpoint and status.",
                                   labels=["endpoint", "status"])
        for (endpoint, status), count in sorted(self.server["requests"]):
            http.add_metric([endpoint, str(status)], count)
        yield http
        yield GaugeMetricFamily("kev_queued_questions", "Questions accepted and not yet answered.",
                                value=self.server["queued"])
        yield histogram("kev_request_latency_seconds", "Time from request to full answer.", self.server["latency"])
        if self.compiling is not None:
            yield GaugeMetricFamily("kev_grammar_compiles_in_flight",
                                    "Grammars compiling or waiting for a compile thread.", value=self.compiling)
        stats = self.engine_stats
        if stats is None:
            return
        info = GaugeMetricFamily("kev_engine_info", "How the engine computes: its dtype, and whether packed equals "
                                 "alone bit for bit.", labels=["dtype", "batch_invariant"])
        info.add_metric([stats["dtype"], str(stats["batch_invariant"]).lower()], 1)
        yield info
        for key, (name, help_text) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, help_text, value=stats[key])
        for key, (name, help_text) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, help_text, value=stats[key])
        target_ms = stats["pass_time_ms"]  # None: passes have no time bound
        yield GaugeMetricFamily("kev_pass_target_seconds", "The pass duration the scheduler fills passes up to.",
                                value=float("inf") if target_ms is None else target_ms / 1000)
        for key, (name, help_text) in ENGINE_HISTOGRAMS.items():
            yield histogram(name, help_text, stats[key])


def histogram(name: str, help_text: str, snapshot: dict[str, Any]) -> HistogramMetricFamily:
    """A `latency.Histogram.snapshot()` (cumulative buckets, as Prometheus counts them) as a family;
    each bound written as prometheus_client's own histograms write `le` ("1.0", "+Inf")."""
    buckets = [(floatToGoString(bound), count) for bound, count in snapshot["buckets"]]
    return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=snapshot["sum"])


def fleet_stats(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """Several engines' `stats()` (Ray replicas) as one for /metrics: its counters and gauges added,
    its histograms merged; what describes an engine (dtype, batch_invariant, the pass target) and
    every stat /metrics does not show from the first."""
    fleet = dict(replicas[0])
    for key in (*ENGINE_COUNTERS, *ENGINE_GAUGES):
        fleet[key] = sum(stats[key] for stats in replicas)
    for key in ENGINE_HISTOGRAMS:
        fleet[key] = merged_histograms([stats[key] for stats in replicas])
    return fleet
