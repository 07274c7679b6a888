"""A paused pass's work by rows of layers, and the pace its slices run at: what sizes them (`Stepper`).

A slice of a pass is the next rows of its layers (`DecoderModel.advance`). Rows do not cost the
same: every row pays the layer's products, the same for each, and its attention over its keys —
its question's tokens up to and including it — so in a prompt of thousands of tokens a row late in
a layer costs several times a row at its start, and the first rows of the next layer are cheap
again. A slice sized by the pace of the one before it in rows alone overshoots each time it moves
on to later rows. So a slice's seconds are taken as `per_row x rows + per_key x keys` (its rows,
and the keys they attend to), the two rates fitted to the slices last run (`SlicePace`), and a
slice holds the rows that this predicts within its time, less the margin by which the slices it
was fitted to overran it: a running answer waits a slice between two tokens, and the target is
what it should wait at most.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Sequence

from .pass_cost import pairs

WINDOW = 8  # slices the pace is fitted to: recent enough to follow the machine, enough for two rates


class SliceWork:
    """A pass's rows of layers (a whole layer is `rows` of them) and the keys each attends to: row
    i of a segment after `past` tokens attends to past + i + 1 (`pass_cost.pairs` counts them)."""

    def __init__(self, past_lens: Sequence[int], cu_seqlens: Sequence[int]) -> None:
        """`past_lens`, `cu_seqlens`: each segment's tokens before this pass, and its rows in it."""
        self.pasts, self.starts = list(past_lens), list(cu_seqlens)
        self.rows = self.starts[-1]
        sizes = (pairs(past, stop - start) for past, start, stop in zip(self.pasts, self.starts, self.starts[1:]))
        self.before = list(itertools.accumulate(sizes, initial=0))  # keys of the segments before each
        self.layer_keys = self.before[-1]

    def keys(self, rows_done: int) -> int:
        """The keys the pass's first `rows_done` rows of layers attend to."""
        layers, row = divmod(rows_done, self.rows)
        segment = bisect.bisect_right(self.starts, row, hi=len(self.pasts)) - 1
        return layers * self.layer_keys + self.before[segment] + pairs(self.pasts[segment], row - self.starts[segment])

    def keys_between(self, start: int, stop: int) -> int:
        return self.keys(stop) - self.keys(start)


class SlicePace:
    """Seconds per row and per key of the slices last run, fitted (least squares, neither rate
    below zero) over the last WINDOW of them, in any pass."""

    def __init__(self) -> None:
        self.slices: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=WINDOW)

    def observe(self, rows: int, keys: int, seconds: float) -> None:
        self.slices.append((rows, keys, seconds))

    @property
    def ready(self) -> bool:
        return bool(self.slices)

    def rates(self) -> tuple[float, float]:
        """(seconds a row, seconds a key). With one slice, or slices whose rows and keys are in
        one proportion, the keys' share is not told apart: a row's rate carries both."""
        rr = sum(r * r for r, _, _ in self.slices)
        kk = sum(k * k for _, k, _ in self.slices)
        rk = sum(r * k for r, k, _ in self.slices)
        rt = sum(r * t for r, _, t in self.slices)
        kt = sum(k * t for _, k, t in self.slices)
        det = rr * kk - rk * rk
        if det > 1e-9 * rr * kk:
            per_row, per_key = (rt * kk - kt * rk) / det, (kt * rr - rt * rk) / det
            if per_row >= 0 and per_key >= 0:
                return per_row, per_key
            if per_row < 0:  # the keys alone carry the time
                return 0.0, kt / kk
        return (rt / rr if rr else 0.0), 0.0

    def margin(self, per_row: float, per_key: float) -> float:
        """How far over the fitted rates the slice that overran them most took (1: none did): a
        slice aims that much under its time, so that slices a noisy machine stretches still end
        within it."""
        over = [t / predicted for r, k, t in self.slices if (predicted := per_row * r + per_key * k) > 0]
        return max([1.0, *over])

    def rows_within(self, work: SliceWork, rows_done: int, seconds: float, most: int) -> int:
        """The most rows after the first `rows_done` (at least one, at most `most`) predicted
        within `seconds`, at the fitted rates and under their margin."""
        per_row, per_key = self.rates()
        seconds /= self.margin(per_row, per_key)
        low, high = 1, max(1, most)
        while low < high:  # the predicted time grows with the rows: the largest count within `seconds`
            middle = (low + high + 1) // 2
            if per_row * middle + per_key * work.keys_between(rows_done, rows_done + middle) <= seconds:
                low = middle
            else:
                high = middle - 1
        return low
