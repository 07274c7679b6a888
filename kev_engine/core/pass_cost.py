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
and takes `fixed + seconds_per_flop x (dense flops + attention_ratio x attention flops)`: the
Linear products and the attention kernel run at rates of their own (attention over a long past
is slower per flop than a product). The three numbers are a least-squares fit over the last
`WINDOW` passes (refitted after each, when next read: a pass of decode steps alone plans nothing
by time and reads none, so it pays no fit), so they follow the machine as it is now: a decode step
is mostly `fixed` (the weights streamed once), a prefill mostly flops, a chunk of a long prompt
mostly attention. Beside them the fit keeps the last `ANCHORS` passes that held a prompt's worth
of tokens (`ANCHOR_TOKENS`), however old: after an answer of a few dozen tokens the window holds
decode steps alone, all of one dense size, and a slope fitted on them (on the attention they add,
a token's worth at a time) says a prompt costs many times what it does, so the next lone
question's prompt would be cut into passes it does not need.

Until a pass has been timed, nothing is predicted: the scheduler keeps that first pass short
(`plan.FIRST_PASS_TOKENS`) so the model learns at once. Then a pass never holds more than
`GROWTH` times the work per second of the best pass timed, or what that first pass held
(`pass_flops`): the fit's swings under load, or its reach from decode steps alone, never plan a
pass of several targets.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

from torch import nn

ENV_VAR = "KEV_PASS_TIME_MS"
WINDOW = 32  # passes the fit reads: enough to span decode steps and prefills, recent enough to follow load
ANCHORS = 8  # the latest passes of ANCHOR_TOKENS or more kept beside the window: the fit's spread in work
ANCHOR_TOKENS = 32  # a pass with this many tokens' worth of products is a prefill's (or many rows'), not a step's
GROWTH = 1.5  # a pass holds at most this times the work per second of the best pass timed (`pass_flops`)


@dataclass(frozen=True)
class Work:
    """Flops per unit of each kind of a pass's work (see the module docstring)."""

    per_token: float
    per_row: float
    per_pair: float

    @classmethod
    def of(cls, model: Any) -> Work:
        """From the model's products (Kev's model, or any HF causal LM's Linear layers) and config."""
        config = model.config
        text = getattr(config, "get_text_config", lambda: config)()
        hidden = int(text.hidden_size)
        layers = int(text.num_hidden_layers)
        heads = int(getattr(text, "num_attention_heads", 1) or 1)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        if hasattr(model, "linears"):  # Kev's own model: its products, the output head last
            sizes = [linear.in_features * linear.out_features for linear in model.linears()]
            head_weights, linear = sizes[-1], sum(sizes)
        else:
            head = model.get_output_embeddings()
            head_weights = head.weight.numel() if getattr(head, "weight", None) is not None else 0
            linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        return cls(per_token=2.0 * max(linear - head_weights, 1), per_row=2.0 * max(head_weights, 1),
                   per_pair=4.0 * heads * head_dim * layers)

    def dense(self, tokens: int, rows: int) -> float:
        """The flops of the Linear products and the output head (attention's are per_pair x pairs)."""
        return self.per_token * tokens + self.per_row * rows


def target_ms(pass_time_ms: float | None, default_ms: float) -> float:
    """The pass target an engine uses: the one given, else `KEV_PASS_TIME_MS`, else its platform's
    default (`Platform.default_pass_ms`); checked ("inf": no time bound, `max_batch_tokens` alone)."""
    source = "pass_time_ms"
    if pass_time_ms is None and os.environ.get(ENV_VAR):
        source, text = ENV_VAR, os.environ[ENV_VAR]
        try:
            pass_time_ms = float(text)
        except ValueError:
            raise ValueError(f"{ENV_VAR}={text!r} is not allowed; use a number of milliseconds > 0, or inf") from None
    if pass_time_ms is None:
        return default_ms
    if isinstance(pass_time_ms, bool) or not isinstance(pass_time_ms, (int, float)) or not pass_time_ms > 0:
        raise ValueError(f"{source}={pass_time_ms!r} is not allowed; use a number of milliseconds > 0 "
                         "(inf: no time bound, max_batch_tokens alone), or None for the device's default")
    return float(pass_time_ms)


def pairs(past: int, take: int) -> int:
    """Query-key pairs of `take` new tokens after `past` (causal: token i sees past + i + 1)."""
    return take * past + take * (take + 1) // 2


class CostModel:
    """Predicted seconds of a pass from its work; `observe` each pass run to keep it current.

    Budgets are counted in dense-equivalent flops (`units`: attention's flops weighted by
    `attention_ratio`). `seconds_per_flop` (and `fixed_s`, `attention_ratio`) given with
    `learn=False`: a model that never changes (tests, scripted schedules).
    """

    def __init__(self, work: Work, *, seconds_per_flop: float | None = None, fixed_s: float = 0.0,
                 attention_ratio: float = 1.0, learn: bool = True, window: int = WINDOW) -> None:
        self.work = work
        self._fitted: tuple[float, float | None, float] = (fixed_s, seconds_per_flop, attention_ratio)
        self._stale = False  # a pass was observed since the last fit: the next read fits
        self.learn = learn
        self.history: deque[tuple[float, float, float]] = deque(maxlen=window)  # (dense, attention, seconds)
        self.anchors: deque[tuple[float, float, float]] = deque(maxlen=ANCHORS)  # the latest heavy ones, any age

    # The fit's three numbers, refitted when read after `observe`: a fit is four least-squares
    # solves, and a pass of decode steps alone reads none of the numbers, so it pays none. Set one
    # and it holds until the next pass is observed, as a fit's would.

    @property
    def fixed_s(self) -> float:
        return self._current()[0]

    @fixed_s.setter
    def fixed_s(self, value: float) -> None:
        self._fitted = (value, *self._current()[1:])

    @property
    def seconds_per_flop(self) -> float | None:
        return self._current()[1]

    @seconds_per_flop.setter
    def seconds_per_flop(self, value: float | None) -> None:
        fixed, _, ratio = self._current()
        self._fitted = (fixed, value, ratio)

    @property
    def attention_ratio(self) -> float:
        return self._current()[2]

    @attention_ratio.setter
    def attention_ratio(self, value: float) -> None:
        self._fitted = (*self._current()[:2], value)

    def _current(self) -> tuple[float, float | None, float]:
        if self._stale:
            self._stale = False
            self._fitted = _fit(self.points())
        return self._fitted

    def units(self, tokens: int, rows: int, pairs: int) -> float:
        """A chunk's work in dense-equivalent flops: what the budget is counted in."""
        return self.work.dense(tokens, rows) + self.attention_ratio * self.work.per_pair * pairs

    @property
    def ready(self) -> bool:
        """Whether it can predict: a pass was timed, or its numbers were given (asked every pass: it
        fits nothing)."""
        return self._stale or self._fitted[1] is not None

    def predict(self, flops: float) -> float:
        assert self.seconds_per_flop is not None, "predict() before any pass was timed"
        return self.fixed_s + self.seconds_per_flop * flops

    def flops_within(self, seconds: float) -> float:
        """The most flops that `seconds` of a pass's time (beyond its fixed part) hold."""
        assert self.seconds_per_flop is not None
        return max(0.0, seconds) / self.seconds_per_flop if self.seconds_per_flop > 0 else math.inf

    def pass_flops(self, seconds: float, at_least: float = 0.0) -> float:
        """The work (in `units`) a pass of `seconds` may hold: what the fit says, but at most
        `GROWTH` times what the timed pass with the most work per second would do in that time,
        or `at_least` (what a pass holds before any was timed) where that is more. Why the bound:
        under load the scheduler fills every pass to the target, so the passes it learns from all
        take about as long; their spread is mostly noise, and the fit's fixed part and attention
        ratio swing with it. From decode steps alone (mostly their fixed part) it extrapolates as
        far. A pass planned on such a swing can run several targets, and everyone waits for it;
        bounded, it runs at most about `GROWTH` of one, and grows by that much a pass from there."""
        flops = self.flops_within(seconds - self.fixed_s)
        rates = [(dense + self.attention_ratio * attention) / took for dense, attention, took in self.points()]
        return min(flops, max(GROWTH * max(rates) * seconds, at_least)) if rates else flops

    def tokens_within(self, flops: float, past: int, rows: int) -> int:
        """The longest chunk of one question, `past` tokens already computed, whose work (its tokens,
        `rows` logit rows, its attention pairs) stays within `flops`."""
        w, per_pair = self.work, self.work.per_pair * self.attention_ratio
        left = flops - w.per_row * rows
        if left <= 0:
            return 0
        if math.isinf(left):
            return 1 << 40
        # per_token x + per_pair (x past + x (x + 1) / 2) <= left: the positive root, rounded down
        a = per_pair / 2
        b = w.per_token + per_pair * (past + 0.5)
        x = (-b + math.sqrt(b * b + 4 * a * left)) / (2 * a) if a > 0 else left / b
        take = max(0, int(x))
        while take > 0 and w.per_token * take + per_pair * pairs(past, take) > left:
            take -= 1  # the float root may round up by one
        return take

    def observe(self, dense: float, attention: float, seconds: float) -> None:
        """A pass of `dense` product flops and `attention` flops took `seconds`: the next read refits."""
        if not self.learn or dense + attention <= 0 or not seconds > 0:
            return
        point = (dense, attention, seconds)
        self.history.append(point)
        if dense >= ANCHOR_TOKENS * self.work.per_token:
            self.anchors.append(point)
        self._stale = True

    def points(self) -> list[tuple[float, float, float]]:
        """What the fit reads: the window, and the anchors that have left it (each pass once)."""
        recent = {id(point) for point in self.history}
        return [point for point in self.anchors if id(point) not in recent] + list(self.history)


class RowCost:
    """What one more row costs a pass of decode rows alone, as measured: the least-squares slope of
    seconds over rows across the last WINDOW such passes (a batch's passes lose rows as its answers
    end, and speculation adds draft rows, so their counts spread). Why beside `CostModel`: its
    rate per flop is mostly a prefill's, where the products run at the kernels' best; a few rows
    more in a decode pass cost what the kernels do at that size, and that decides whether a draft
    row pays (`Scheduler._drafts`)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.points: deque[tuple[int, float]] = deque(maxlen=window)  # (rows, seconds)

    def observe(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            self.points.append((rows, seconds))

    def per_row(self) -> float | None:
        """Seconds per row (never below 0), or None until two row counts were timed."""
        n = len(self.points)
        if n < 2:
            return None
        mean_rows = sum(r for r, _ in self.points) / n
        mean_s = sum(t for _, t in self.points) / n
        spread = sum((r - mean_rows) ** 2 for r, _ in self.points)
        if spread == 0:
            return None
        return max(0.0, sum((r - mean_rows) * (t - mean_s) for r, t in self.points) / spread)


def _fit(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least squares `seconds = fixed + dense_rate x dense + attention_rate x attention`, every
    number >= 0: the full fit where it is, else the best of the simpler ones (one rate for both
    kinds, no fixed part); returns (fixed, dense_rate, attention_rate / dense_rate)."""
    import numpy as np

    data = np.array(points, dtype=np.float64)  # [n, 3]
    dense, attention, seconds = data[:, 0], data[:, 1], data[:, 2]
    scale = max(float(np.mean(dense + attention)), 1.0)  # conditioning: flops in units of a mean pass
    ones = np.ones_like(dense)
    candidates = [  # columns, and how (fixed, dense_rate, attention_rate) come from the solution
        (np.stack([ones, dense / scale, attention / scale], 1), lambda c: (c[0], c[1], c[2])),
        (np.stack([ones, (dense + attention) / scale], 1), lambda c: (c[0], c[1], c[1])),
        (np.stack([dense / scale, attention / scale], 1), lambda c: (0.0, c[0], c[1])),
        (np.stack([(dense + attention) / scale], 1), lambda c: (0.0, c[0], c[0])),
    ]
    best: tuple[float, tuple[float, float, float]] | None = None
    for columns, unpack in candidates:
        if len(points) < columns.shape[1]:
            continue
        solution, _, rank, _ = np.linalg.lstsq(columns, seconds, rcond=None)  # rank: matrix_rank's tolerance
        if rank < columns.shape[1]:
            continue
        fixed, dense_rate, attention_rate = unpack(solution)
        if fixed < 0 or dense_rate <= 0 or attention_rate <= 0:
            continue
        error = float(np.sum((columns @ solution - seconds) ** 2))
        if best is None or error < best[0] * 0.999:  # a simpler fit only when clearly better
            best = (error, (float(fixed), float(dense_rate) / scale, float(attention_rate) / scale))
    if best is None:  # nothing fits with positive rates: all time proportional to all work
        total = float(np.sum(dense + attention))
        return 0.0, float(np.sum(seconds)) / total, 1.0
    fixed, dense_rate, attention_rate = best[1]
    return fixed, dense_rate, attention_rate / dense_rate
