"""Prometheus text for GET /metrics: the server's own counters plus the engine's stats.

Written by hand (the exposition format is a few lines of text) rather than pulling in a client
library; names follow Prometheus conventions (`_total` counters, `_seconds` histograms).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from kev_engine import Histogram, prometheus

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ENGINE_COUNTERS = {  # engine stat → (metric, help)
    "requests": ("kev_requests_total", "Questions the engine took (a prompt counts once, whatever its n)."),
    "forward_passes": ("kev_forward_passes_total", "Packed forward passes run."),
    "prefill_passes": ("kev_prefill_passes_total", "Passes that prefilled at least one prompt."),
    "decode_steps": ("kev_decode_steps_total", "Passes that decoded at least one token."),
    "pass_slices": ("kev_pass_pauses_total", "Times a pass paused between its layers for other passes to run."),
    "paused_seconds": ("kev_pass_paused_seconds_total", "Time passes spent paused while other passes ran."),
    "prompt_tokens": ("kev_prompt_tokens_total", "Prompt tokens admitted."),
    "generated_tokens": ("kev_generated_tokens_total", "Tokens generated."),
    "draft_tokens": ("kev_draft_tokens_total", "Draft tokens verified in packed passes (speculative decoding)."),
    "draft_accepted_tokens": ("kev_draft_accepted_tokens_total", "Of the draft tokens, those the answers took."),
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

    def render(self, engine_stats: dict[str, Any] | None, compiling: int | None = None) -> str:
        """The exposition text; `compiling`: grammars the server is compiling or about to (left out if None)."""
        lines = ["# HELP kev_http_requests_total HTTP requests by endpoint and status.",
                 "# TYPE kev_http_requests_total counter"]
        with self._lock:
            for (endpoint, status), count in sorted(self.requests.items()):
                lines.append(f'kev_http_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}')
            lines += ["# HELP kev_queued_questions Questions accepted and not yet answered.",
                      "# TYPE kev_queued_questions gauge", f"kev_queued_questions {self.queued}"]
            lines += prometheus("kev_request_latency_seconds", "Time from request to full answer.",
                                self.latency.snapshot())
        if compiling is not None:
            lines += ["# HELP kev_grammar_compiles_in_flight Grammars compiling or waiting for a compile thread.",
                      "# TYPE kev_grammar_compiles_in_flight gauge", f"kev_grammar_compiles_in_flight {compiling}"]
        if engine_stats is not None:
            lines += ["# HELP kev_engine_info How the engine computes: its dtype, and whether packed equals alone "
                      "bit for bit.", "# TYPE kev_engine_info gauge",
                      f'kev_engine_info{{dtype="{engine_stats["dtype"]}",'
                      f'batch_invariant="{str(engine_stats["batch_invariant"]).lower()}"}} 1']
            for table, kind in ((ENGINE_COUNTERS, "counter"), (ENGINE_GAUGES, "gauge")):
                for key, (name, help_text) in table.items():
                    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {engine_stats[key]}"]
            lines += ["# HELP kev_pass_target_seconds The pass duration the scheduler fills passes up to.",
                      "# TYPE kev_pass_target_seconds gauge",
                      f"kev_pass_target_seconds {_seconds(engine_stats['pass_time_ms'])}"]
            for key, (name, help_text) in ENGINE_HISTOGRAMS.items():
                lines += prometheus(name, help_text, engine_stats[key])
        return "\n".join(lines) + "\n"


def _seconds(milliseconds: float | None) -> str:
    return "+Inf" if milliseconds is None else str(milliseconds / 1000)
