"""What a pass costs in time: the scheduler's model of this device and this model, learnt as it runs.

Why: a pass is the unit of work, and nobody moves while it runs. On a GPU a pass of 8,192
tokens takes tens of milliseconds; on a CPU it takes seconds, so a short question queued behind
a long prompt would wait the whole prefill. The scheduler fills each pass up to a target
duration (`Engine(pass_time_ms=...)`) instead of a token count, and this model says how many
tokens fit.

The model: a pass does floating-point work in three kinds, each counted from the model's shapes,
  tokens  every new token goes through every Linear layer: 2 x (their weights) flops;
  rows    each row whose logits are kept goes through the output head: 2 x hidden x vocab;
  pairs   each new token attends to every earlier position of its own question (and itself):
          4 x (query heads x head dim) x layers per query-key pair, scores and weighted values;
and takes `fixed + seconds_per_flop x flops`. The two numbers are a least-squares fit over the
last `WINDOW` passes (refreshed after each), so they follow the machine as it is now: a decode
step is mostly `fixed` (the weights streamed once), a prefill mostly flops. Until a pass has
been timed, nothing is predicted: the scheduler keeps that first pass short (`FIRST_PASS_TOKENS`)
so the model learns at once.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

from torch import nn

ENV_VAR = "KEV_PASS_TIME_MS"
DEFAULT_MS = {"cpu": 300.0, "cuda": 100.0}  # a short question's first token within about two passes
WINDOW = 32  # passes the fit reads: enough to span decode steps and prefills, recent enough to follow load


@dataclass(frozen=True)
class Work:
    """Flops per unit of each kind of a pass's work (see the module docstring)."""

    per_token: float
    per_row: float
    per_pair: float

    @classmethod
    def of(cls, model: Any) -> Work:
        """From the model's own Linear layers and config (any HF causal LM)."""
        config = model.config
        text = getattr(config, "get_text_config", lambda: config)()
        hidden = int(text.hidden_size)
        layers = int(text.num_hidden_layers)
        heads = int(getattr(text, "num_attention_heads", 1) or 1)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        head = model.get_output_embeddings()
        head_weights = head.weight.numel() if getattr(head, "weight", None) is not None else 0
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        return cls(per_token=2.0 * max(linear - head_weights, 1), per_row=2.0 * max(head_weights, 1),
                   per_pair=4.0 * heads * head_dim * layers)

    def flops(self, tokens: int, rows: int, pairs: int) -> float:
        return self.per_token * tokens + self.per_row * rows + self.per_pair * pairs


def target_ms(pass_time_ms: float | None, device: Any) -> float:
    """The pass target an engine on `device` uses: the one given, else `KEV_PASS_TIME_MS`, else the
    device's default; checked ("inf": no time bound, `max_batch_tokens` alone)."""
    source = "pass_time_ms"
    if pass_time_ms is None and os.environ.get(ENV_VAR):
        source, text = ENV_VAR, os.environ[ENV_VAR]
        try:
            pass_time_ms = float(text)
        except ValueError:
            raise ValueError(f"{ENV_VAR}={text!r} is not allowed; use a number of milliseconds > 0, or inf") from None
    if pass_time_ms is None:
        return DEFAULT_MS.get(getattr(device, "type", str(device)), DEFAULT_MS["cpu"])
    if isinstance(pass_time_ms, bool) or not isinstance(pass_time_ms, (int, float)) or not pass_time_ms > 0:
        raise ValueError(f"{source}={pass_time_ms!r} is not allowed; use a number of milliseconds > 0 "
                         "(inf: no time bound, max_batch_tokens alone), or None for the device's default")
    return float(pass_time_ms)


def pairs(past: int, take: int) -> int:
    """Query-key pairs of `take` new tokens after `past` (causal: token i sees past + i + 1)."""
    return take * past + take * (take + 1) // 2


class CostModel:
    """Predicted seconds of a pass from its flops; `observe` each pass run to keep it current.

    `seconds_per_flop` and `fixed_s` given and `learn=False`: a model that never changes (tests,
    scripted schedules).
    """

    def __init__(self, work: Work, *, seconds_per_flop: float | None = None, fixed_s: float = 0.0,
                 learn: bool = True, window: int = WINDOW) -> None:
        self.work = work
        self.seconds_per_flop = seconds_per_flop
        self.fixed_s = fixed_s
        self.learn = learn
        self.history: deque[tuple[float, float]] = deque(maxlen=window)  # (flops, seconds)

    @property
    def ready(self) -> bool:
        """Whether it can predict: a pass was timed, or its numbers were given."""
        return self.seconds_per_flop is not None

    def predict(self, flops: float) -> float:
        assert self.seconds_per_flop is not None, "predict() before any pass was timed"
        return self.fixed_s + self.seconds_per_flop * flops

    def flops_within(self, seconds: float) -> float:
        """The most flops that `seconds` of a pass's time (beyond its fixed part) hold."""
        assert self.seconds_per_flop is not None
        return max(0.0, seconds) / self.seconds_per_flop if self.seconds_per_flop > 0 else math.inf

    def tokens_within(self, flops: float, past: int, rows: int) -> int:
        """The longest chunk of one question, `past` tokens already computed, whose work (its tokens,
        `rows` logit rows, its attention pairs) stays within `flops`."""
        w = self.work
        left = flops - w.per_row * rows
        if left <= 0:
            return 0
        if math.isinf(left):
            return 1 << 40
        # per_token x + per_pair (x past + x (x + 1) / 2) <= left: the positive root, rounded down
        a = w.per_pair / 2
        b = w.per_token + w.per_pair * (past + 0.5)
        x = (-b + math.sqrt(b * b + 4 * a * left)) / (2 * a) if a > 0 else left / b
        take = max(0, int(x))
        while take > 0 and w.per_token * take + w.per_pair * pairs(past, take) > left:
            take -= 1  # the float root may round up by one
        return take

    def observe(self, flops: float, seconds: float) -> None:
        """A pass of `flops` took `seconds`: refit over the recent passes."""
        if not self.learn or flops <= 0 or not seconds > 0:
            return
        self.history.append((flops, seconds))
        self.fixed_s, self.seconds_per_flop = _fit(self.history)


def _fit(points: deque[tuple[float, float]]) -> tuple[float, float]:
    """Least squares `seconds = fixed + rate x flops` with fixed >= 0 and rate > 0; one point, or
    points whose flops barely differ, give the rate through the origin (the cautious reading:
    all of a pass's time scales with its work)."""
    n = len(points)
    mean_f = sum(f for f, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    spread = sum((f - mean_f) ** 2 for f, _ in points)
    if n >= 2 and spread > (0.1 * mean_f) ** 2 * n:
        rate = sum((f - mean_f) * (s - mean_s) for f, s in points) / spread
        fixed = mean_s - rate * mean_f
        if rate > 0 and fixed >= 0:
            return fixed, rate
    return 0.0, sum(s for _, s in points) / sum(f for f, _ in points)
