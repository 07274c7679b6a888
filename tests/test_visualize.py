"""Seeing a pack: the segment table and the mask picture follow the real pack layout."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import QUESTIONS
from PIL import Image

from kev_engine import Engine, InvalidRequestError
from kev_engine import visualize as vis


def find_mask(path, side: int) -> tuple[np.ndarray, int, int]:
    """Locate the mask inside its INK frame: ([side, side, 3] pixels, left, top)."""
    pixels = np.asarray(Image.open(path).convert("RGB"))  # [H, W, 3]
    ink = (pixels == vis.INK).all(-1)
    frame_rows = np.flatnonzero(ink.sum(1) >= side)
    frame_cols = np.flatnonzero(ink.sum(0) >= side)
    top, bottom = frame_rows[0] + 1, frame_rows[-1]
    left, right = frame_cols[0] + 1, frame_cols[-1]
    assert (bottom - top, right - left) == (side, side), "mask is not side x side pixels"
    return pixels[top:bottom, left:right], left, top


def test_segment_table_matches_encode_and_is_contiguous(tiny_engine: Engine) -> None:
    rows = vis.segment_table(tiny_engine, QUESTIONS, adapters=[None, "sql", None, "sql", None])
    lengths = [len(tiny_engine.encode(q)) for q in QUESTIONS]
    assert [r["tokens"] for r in rows] == lengths
    assert [r["question"] for r in rows] == list(range(len(QUESTIONS)))
    assert [r["adapter"] for r in rows] == ["base", "sql", "base", "sql", "base"]
    assert rows[0]["start"] == 0
    assert all(a["end"] == b["start"] for a, b in zip(rows, rows[1:]))
    assert all(r["end"] - r["start"] == r["tokens"] for r in rows)


def test_segment_table_refuses_bad_input(tiny_engine: Engine) -> None:
    with pytest.raises(ValueError, match="2 adapters for 1 prompts"):
        vis.segment_table(tiny_engine, ["hi"], adapters=["a", "b"])
    with pytest.raises(ValueError, match="no prompts"):
        vis.segment_table(tiny_engine, [])
    with pytest.raises(InvalidRequestError, match="question 1"):
        vis.segment_table(tiny_engine, ["hi", "   "])


def test_mask_pixels_are_exactly_the_block_diagonal_causal_mask(tiny_engine: Engine, tmp_path) -> None:
    path = tmp_path / "pack.png"
    rows = vis.draw_pack_mask(tiny_engine, QUESTIONS[:4], path)
    num_tokens = rows[-1]["end"]
    side = max(num_tokens, vis.MIN_SIDE)  # a small pack is scaled up
    mask, _, _ = find_mask(path, side)
    # which token each pixel row/column shows, and its segment (pixel level, not T x T)
    token = ((np.arange(side) + 0.5) * num_tokens / side).astype(int)  # [side]
    segment = np.searchsorted([r["end"] for r in rows], token, side="right")  # [side]
    allowed = (segment[:, None] == segment[None, :]) & (token[None, :] <= token[:, None])  # [query, key]
    grid = (mask == vis.GRID).all(-1)
    coloured = ~(mask == vis.BACKGROUND).all(-1) & ~grid
    assert not (coloured != allowed)[~grid].any()
    for i in range(len(rows)):  # each question's triangle has its own colour
        inside = allowed & (segment[:, None] == i) & ~grid
        assert (mask[inside] == vis.PALETTE[i]).all()


def test_downscaled_mask_keeps_the_block_structure(tiny_engine: Engine, tmp_path) -> None:
    path = tmp_path / "small.png"
    rows = vis.draw_pack_mask(tiny_engine, [QUESTIONS[0], QUESTIONS[1], QUESTIONS[4]], path, max_pixels=64)
    num_tokens = rows[-1]["end"]
    assert num_tokens > 64  # really downscaled
    mask, _, _ = find_mask(path, 64)
    scale = 64 / num_tokens

    def pixel(query: float, key: float) -> tuple[int, ...]:
        return tuple(mask[int(query * scale), int(key * scale)])

    for i, row in enumerate(rows):
        start, n = row["start"], row["tokens"]
        assert pixel(start + 0.8 * n, start + 0.2 * n) == vis.PALETTE[i]  # lower triangle: allowed
        assert pixel(start + 0.2 * n, start + 0.8 * n) == vis.BACKGROUND  # future tokens: masked
    first, second = (row["start"] + row["tokens"] / 2 for row in rows[:2])  # middle token of each
    assert pixel(second, first) == vis.BACKGROUND  # a later question never sees an earlier one
    assert pixel(first, second) == vis.BACKGROUND


def test_huge_pack_is_drawn_at_max_pixels(tmp_path) -> None:
    # 300k tokens: a dense mask would be 9e10 cells; the drawing must scale, not materialize it
    fake = SimpleNamespace(encode=lambda n: [1] * n)
    lengths = [120_000, 100_000, 50_000] + [1_000] * 30
    rows = vis.draw_pack_mask(fake, lengths, tmp_path / "huge.png", max_pixels=256)
    assert [r["tokens"] for r in rows] == lengths
    mask, _, _ = find_mask(tmp_path / "huge.png", 256)
    assert tuple(mask[200, 10]) == vis.BACKGROUND  # queries of question 1, keys of question 0
    assert tuple(mask[90, 10]) == vis.PALETTE[0]


def test_format_table_aligns_columns() -> None:
    rows = [{"question": 0, "adapter": "base", "start": 0, "end": 7, "tokens": 7},
            {"question": 1, "adapter": "sql", "start": 7, "end": 1200, "tokens": 1193}]
    lines = vis.format_table(rows).splitlines()
    assert lines[0].split() == list(vis.COLUMNS)
    assert len({len(line) for line in lines}) == 1
    assert lines[2].split() == ["1", "sql", "7", "1200", "1193"]
