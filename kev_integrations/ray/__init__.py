"""Kev on Ray (extra: ``kev-llm[ray]``): Serve replicas behind one OpenAI-compatible endpoint, and
Ray Data batch jobs where every batch of rows is one packed pass.

- `build_app` (`serve.py`): a Ray Serve application: an ingress that routes each request by the
  adapter it names to a replica already holding it (Serve's model multiplexing), and replicas that
  each run one `Engine` behind the same app as `kev serve`.
- `KevPredictor` (`data.py`): a callable class for ``ds.map_batches(KevPredictor,
  compute=ActorPoolStrategy(size=N, max_tasks_in_flight_per_actor=1))``.

Both are imported on first use, so importing this package does not import Ray.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KevPredictor", "build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from .serve import build_app

        return build_app
    if name == "KevPredictor":
        from .data import KevPredictor

        return KevPredictor
    raise AttributeError(name)
