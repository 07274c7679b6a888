"""Seeing a pack: the segment table and the mask picture follow the real pack layout, shared prefixes included."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import QUESTIONS, chat, make_adapter, tiny_model
from PIL import Image

from kev_engine import Engine, InvalidRequestError, SamplingParams
from kev_engine.tools import visualize as vis


def runs_of(ink: np.ndarray, length: int) -> np.ndarray:
    """[H, W] bool → [H]: rows holding `length` consecutive True pixels (a frame edge, never text)."""
    counts = np.pad(np.cumsum(ink, axis=1), ((0, 0), (1, 0)))  # [H, W + 1]
    return ((counts[:, length:] - counts[:, :-length]) == length).any(1)


def find_mask(path, side: int) -> tuple[np.ndarray, int, int]:
    """Locate the mask inside its INK frame: ([side, side, 3] pixels, left, top)."""
    pixels = np.asarray(Image.open(path).convert("RGB"))  # [H, W, 3]
    ink = (pixels == vis.INK).all(-1)
    frame_rows = np.flatnonzero(runs_of(ink, side))
    frame_cols = np.flatnonzero(runs_of(ink.T, side))
    top, bottom = frame_rows[0] + 1, frame_rows[-1]
    left, right = frame_cols[0] + 1, frame_cols[-1]
    assert (bottom - top, right - left) == (side, side), "mask is not side x side pixels"
    return pixels[top:bottom, left:right], left, top


def test_segment_table_matches_encode_and_is_contiguous(tiny_engine: Engine) -> None:
    rows = vis.segment_table(tiny_engine, QUESTIONS, adapters=[None, "sql", None, "sql", None])
    lengths = [len(tiny_engine.encode(q)) for q in QUESTIONS]
    assert [r["shared_prefix"] for r in rows] == [0] * len(QUESTIONS)  # no common full block
    assert [r["tokens"] for r in rows] == lengths
    assert [r["id"] for r in rows] == list(range(len(QUESTIONS)))  # ids default to positions
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
    with pytest.raises(InvalidRequestError, match="question 'b'"):
        vis.segment_table(tiny_engine, ["hi", "   "], ids=["a", "b"])
    with pytest.raises(ValueError, match="1 ids for 2 prompts"):
        vis.segment_table(tiny_engine, ["hi", "ho"], ids=["a"])


DOC = "The Harbour Museum opened in 1998 in a former customs house and holds a lighthouse lens from 1874. " * 3
DOC_QUESTIONS = [chat(q, DOC) for q in ("When did it open?", "What does it hold?", "Where is it?")]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_questions_about_one_document_share_its_blocks(tiny_engine: Engine) -> None:
    prompts = [*DOC_QUESTIONS, DOC_QUESTIONS[0], DOC_QUESTIONS[1], QUESTIONS[0]]
    adapters = [None, None, None, "sql", "sql", None]
    ids = ["museum-1", "museum-2", "museum-3", "museum-sql-1", "museum-sql-2", "paris"]
    rows = vis.segment_table(tiny_engine, prompts, adapters, ids=ids)
    block_size = tiny_engine.stats()["kv_block_size"]
    encoded = [tiny_engine.encode(p) for p in prompts]
    doc_prefix = common_prefix(encoded[0], encoded[1]) // block_size * block_size  # whole blocks only
    assert doc_prefix >= 2 * block_size
    assert [r["id"] for r in rows] == ids
    # the first question about the document computes it; later ones with the same adapter reuse it;
    # another adapter never shares with the base model, only with itself
    assert [r["shared_prefix"] for r in rows] == [0, doc_prefix, doc_prefix, 0, doc_prefix, 0]
    assert [r["tokens"] for r in rows] == [len(e) - r["shared_prefix"] for e, r in zip(encoded, rows)]
    assert rows[0]["start"] == 0 and all(a["end"] == b["start"] for a, b in zip(rows, rows[1:]))


def test_a_repeated_prompt_still_computes_its_last_token(tiny_engine: Engine) -> None:
    block_size = tiny_engine.stats()["kv_block_size"]
    prompt = "word " * (3 * block_size)
    length = len(tiny_engine.encode(prompt))
    rows = vis.segment_table(tiny_engine, [prompt, prompt])
    assert rows[1]["shared_prefix"] == (length - 1) // block_size * block_size  # never the last token
    assert rows[1]["tokens"] == length - rows[1]["shared_prefix"] >= 1


def test_the_table_matches_what_the_engine_reuses_in_one_pass(tiny_engine: Engine, tmp_path) -> None:
    tiny_engine.load_adapter("sql", str(make_adapter(tiny_model("llama", tiny_engine.tokenizer), tmp_path / "sql")))
    prompts = [*DOC_QUESTIONS, DOC_QUESTIONS[0], DOC_QUESTIONS[2]]
    adapters = [None, None, None, "sql", "sql"]
    rows = vis.segment_table(tiny_engine, prompts, adapters)
    done = tiny_engine.generate(prompts, SamplingParams(max_tokens=1), adapters=adapters)
    assert tiny_engine.stats()["forward_passes"] == 1  # one pass: prefixes shared within it
    assert [r["shared_prefix"] for r in rows] == [c.cached_tokens for c in done]
    assert [r["shared_prefix"] + r["tokens"] for r in rows] == [c.prompt_tokens for c in done]


def test_mask_pixels_are_exactly_the_causal_mask_with_shared_prefix_reads(tiny_engine: Engine, tmp_path) -> None:
    path = tmp_path / "pack.png"
    prompts = [*DOC_QUESTIONS, QUESTIONS[0], QUESTIONS[3]]
    rows = vis.draw_pack_mask(tiny_engine, prompts, path)
    assert [r["shared_prefix"] > 0 for r in rows] == [False, True, True, False, False]
    num_tokens = rows[-1]["end"]
    side = max(num_tokens, vis.MIN_SIDE)  # a small pack is scaled up
    mask, _, _ = find_mask(path, side)
    # which token each pixel row/column shows, and its segment (pixel level, not T x T)
    token = ((np.arange(side) + 0.5) * num_tokens / side).astype(int)  # [side]
    segment = np.searchsorted([r["end"] for r in rows], token, side="right")  # [side]
    own = (segment[:, None] == segment[None, :]) & (token[None, :] <= token[:, None])  # [query, key]
    # a sharing question also reads the document's blocks, which question 0 computes at keys [0, shared)
    shared = np.array([r["shared_prefix"] for r in rows])[segment]  # [side] per query row
    reads = token[None, :] < shared[:, None]  # [query, key]
    grid = (mask == vis.GRID).all(-1)
    coloured = ~(mask == vis.BACKGROUND).all(-1) & ~grid
    assert not (coloured != (own | reads))[~grid].any()
    hatch = (mask == vis.SHARED).all(-1)
    for i in range(len(rows)):  # each question's triangle has its own colour
        inside = own & (segment[:, None] == i) & ~grid
        assert (mask[inside] == vis.PALETTE[i]).all()
        read = reads & (segment[:, None] == i) & ~grid  # hatched over a tint of the reader's colour
        assert (hatch[read] | (mask[read] == vis.tint(vis.PALETTE[i])).all(-1)).all()
        assert hatch[read].any() == (rows[i]["shared_prefix"] > 0)
    assert not hatch[(segment == 0) | (segment >= 3)].any()  # hatch only in the rows of sharing questions


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
    fake = SimpleNamespace(encode=lambda n: [n % 977] * n, stats=lambda: {"kv_block_size": 256})
    lengths = [120_000, 100_000, 50_000] + [1_000 + i for i in range(30)]  # distinct tokens: nothing shared
    rows = vis.draw_pack_mask(fake, lengths, tmp_path / "huge.png", max_pixels=256)
    assert [r["tokens"] for r in rows] == lengths and not any(r["shared_prefix"] for r in rows)
    mask, _, _ = find_mask(tmp_path / "huge.png", 256)
    assert tuple(mask[200, 10]) == vis.BACKGROUND  # queries of question 1, keys of question 0
    assert tuple(mask[90, 10]) == vis.PALETTE[0]


def test_format_table_aligns_columns() -> None:
    rows = [{"id": "museum-1", "adapter": "base", "shared_prefix": 0, "start": 0, "end": 7, "tokens": 7},
            {"id": 1, "adapter": "sql", "shared_prefix": 96, "start": 7, "end": 1200, "tokens": 1193}]
    lines = vis.format_table(rows).splitlines()
    assert lines[0].split() == list(vis.COLUMNS)
    assert len({len(line) for line in lines}) == 1
    assert lines[2].split() == ["1", "sql", "96", "7", "1200", "1193"]
    assert lines[1].startswith("museum-1") and lines[2].startswith("1 ")  # ids left-aligned


def test_every_question_of_a_large_pack_has_its_own_colour_and_labels_name_adapters() -> None:
    colours = [vis.colour(i) for i in range(200)]
    assert len(set(colours)) == 200 and colours[:10] == vis.PALETTE  # not the palette again after ten
    assert vis._label({"id": "q1", "adapter": "sql"}) == "q1 (sql)" and vis._label({"id": 3, "adapter": "base"}) == "3"


def test_the_shared_prefix_legend_is_drawn_only_when_something_is_shared(tiny_engine: Engine, tmp_path) -> None:
    heights = {}
    for name, prompts in (("private", [QUESTIONS[0], QUESTIONS[3]]), ("shared", DOC_QUESTIONS[:2])):
        rows = vis.draw_pack_mask(tiny_engine, prompts, tmp_path / f"{name}.png")
        side = max(rows[-1]["end"], vis.MIN_SIDE)
        table = vis.LINE * (len(rows) + 1)  # header and one line a question
        drawn = Image.open(tmp_path / f"{name}.png").height
        heights[name] = drawn - (vis.PAD + 3 * vis.LINE + side + 2 * vis.PAD + table)
    assert heights == {"private": 0, "shared": vis.LINE}  # the hatch legend's line, only where a prefix is read
