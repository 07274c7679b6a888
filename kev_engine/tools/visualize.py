"""Seeing a pack: which tokens of one packed prefill pass may attend to which.

A debugging aid beside the flow (tokenize → blocks → pack), not part of it. The prompts are
encoded with `engine.encode`, given KV blocks in order by a local `BlockManager` with the
engine's block size (a fresh cache, so only sharing within this one pass), and the suffixes
the engine would compute are laid out by the real `pack()`. What you see is what one prefill
pass of these questions is given:

- Both axes are the pass's packed tokens, T = the tokens it computes (a question that reuses
  a prefix contributes only its suffix). Rows are queries, columns are keys.
- A question's own tokens attend causally to each other: one solid lower triangle per
  segment on the diagonal, in the question's colour.
- A question that reuses a prefix (whole KV blocks, same adapter) also reads those blocks'
  keys, which an earlier question of the same pass computes: the key columns of the shared
  prefix lie in the writer's segment, and the reader's rows get a full-height rectangle over
  them (it attends to all of the prefix), hatched over a tint of the reader's colour. Several
  hatched rectangles in one column range are one block several segments attend to.
- Everything else is white: masked out.

The mask is never built as a dense T×T array: triangles are polygons and reads are rectangles,
drawn in scaled pixel coordinates. The segment table underneath gives each question's id,
adapter, shared prefix (tokens reused) and `[start, end)` in the packed pass.
"""

from __future__ import annotations

import colorsys
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..core.blocks import BlockManager, BlockTable, blocks_for
from ..errors import InvalidRequestError
from ..model.pack import PackedBatch, Segment, pack
from ..platforms.base import AttentionBackend

BACKGROUND = (255, 255, 255)  # masked out: no attention
GRID = (190, 190, 190)
INK = (30, 30, 30)
SHARED = (70, 70, 70)  # hatch lines over a shared-prefix read
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
MIN_SIDE = 512  # small packs are scaled up to this, so one token is several pixels wide
PAD, LINE, HATCH = 12, 18, 6
COLUMNS = ("id", "adapter", "shared_prefix", "start", "end", "tokens")
TEXT_COLUMNS = ("id", "adapter")  # left-aligned; numbers are right-aligned


def colour(i: int) -> tuple[int, int, int]:
    """Question i's colour: the palette's ten, then hues spread by the golden angle, so no two
    questions of a pack share one however many there are."""
    if i < len(PALETTE):
        return PALETTE[i]
    hue = (i * 0.618033988749895) % 1.0
    r, g, b = colorsys.hsv_to_rgb(hue, 0.65 + 0.35 * ((i // 7) % 2), 0.85 - 0.25 * ((i // 3) % 2))
    return round(r * 255), round(g * 255), round(b * 255)


def tint(colour: tuple[int, int, int]) -> tuple[int, int, int]:
    """The lighter shade a question's shared-prefix reads are filled with, under the hatch."""
    return tuple(round(c + 0.55 * (255 - c)) for c in colour)  # type: ignore[return-value]


class _Drawing(AttentionBackend):
    """A backend that only places tokens in blocks (what `pack()` asks of one); a drawing runs no model."""

    name = "drawing"

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.bind(SimpleNamespace(block_size=block_size))


@dataclass
class PackLayout:
    """One packed prefill pass and, per segment, the key ranges it reads from earlier segments."""

    batch: PackedBatch
    ids: list[Any]  # [S] the questions' ids
    shared: list[int]  # [S] prompt tokens whose KV is reused
    reads: list[list[tuple[int, int]]]  # [S] [key_start, key_end) ranges of the packed pass


def layout_pack(
    engine: Any,
    prompts: Sequence[Any],
    adapters: Sequence[str | None] | None = None,
    ids: Sequence[Any] | None = None,
) -> PackLayout:
    """Encode each prompt, share prefix blocks as the engine does within one pass, pack the rest."""
    if not prompts:
        raise ValueError("no prompts to pack; give at least one")
    adapters = [None] * len(prompts) if adapters is None else list(adapters)
    ids = list(range(len(prompts))) if ids is None else list(ids)
    for name, given in (("adapters", adapters), ("ids", ids)):
        if len(given) != len(prompts):
            raise ValueError(f"got {len(given)} {name} for {len(prompts)} prompts; give one per prompt or None")
    encoded = []
    for i, prompt in enumerate(prompts):
        try:
            encoded.append(engine.encode(prompt))
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"question {ids[i]!r}: {exc}") from exc
    block_size = engine.stats()["kv_block_size"]
    manager = BlockManager(sum(blocks_for(len(t), block_size) for t in encoded), block_size)  # room for all
    written: dict[int, int] = {}  # block id → packed position of its first token, for blocks computed here
    segments, shared, reads = [], [], []
    cursor = 0
    for i, (token_ids, adapter) in enumerate(zip(encoded, adapters)):
        table, extra = BlockTable(), (adapter, None)  # (adapter, cache_salt): other adapters never match
        reused = manager.allocate(table, token_ids, extra)
        assert reused is not None, "the local pool holds every prompt"
        manager.announce(table, token_ids, extra, len(token_ids))  # findable by later questions of the pass
        for j, block_id in enumerate(table.block_ids[reused // block_size :], start=reused // block_size):
            written.setdefault(block_id, cursor + j * block_size - reused)
        ranges: list[tuple[int, int]] = []
        for block_id in table.block_ids[: reused // block_size]:  # merge a writer's consecutive blocks
            start = written[block_id]
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], start + block_size)
            else:
                ranges.append((start, start + block_size))
        segments.append(Segment(i, token_ids[reused:], reused, needs_logits=True, block_ids=table.block_ids,
                                adapter=adapter))
        shared.append(reused)
        reads.append(ranges)
        cursor += len(token_ids) - reused
    return PackLayout(pack(segments, backend=_Drawing(block_size)), ids, shared, reads)


def _rows(layout: PackLayout) -> list[dict[str, Any]]:
    batch, cu = layout.batch, layout.batch.cu_seqlens_list
    return [
        {"id": qid, "adapter": adapter or "base", "shared_prefix": shared, "start": start, "end": end,
         "tokens": end - start}
        for qid, adapter, shared, start, end in zip(layout.ids, batch.adapters, layout.shared, cu, cu[1:])
    ]


def segment_table(
    engine: Any,
    prompts: Sequence[Any],
    adapters: Sequence[str | None] | None = None,
    ids: Sequence[Any] | None = None,
) -> list[dict]:
    """One row per question: its prefix reused, and where its own tokens sit in the pass, `[start, end)`."""
    return _rows(layout_pack(engine, prompts, adapters, ids))


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The segment table as aligned text: names left-aligned, numbers right-aligned."""
    cells = [list(COLUMNS)] + [[str(row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) if c in TEXT_COLUMNS else cell.rjust(w) for c, cell, w in zip(COLUMNS, line, widths))
        for line in cells
    )


def _segment_polygon(start: int, end: int, scale: float, origin: tuple[int, int]) -> list[tuple[int, int]]:
    """Outline of the allowed cells (start <= key <= query < end), inclusive pixel coordinates."""
    left, top = origin

    def at(pos: int) -> int:  # first pixel of token `pos` along either axis
        return round(pos * scale)

    if scale < 1:  # several tokens per pixel: a plain triangle is as exact as the pixels allow
        corner = max(at(end) - 1, at(start))
        points = [(at(start), at(start)), (corner, corner), (at(start), corner)]
    else:  # a staircase, so each diagonal cell (a token attending to itself) is drawn whole
        points = [(at(start), at(start))]
        for q in range(start, end):
            points += [(at(q + 1) - 1, at(q)), (at(q + 1) - 1, at(q + 1) - 1)]
        points.append((at(start), at(end) - 1))
    return [(left + x, top + y) for x, y in points]


def _hatch(image: Image.Image, box: tuple[int, int, int, int], fill: tuple[int, int, int]) -> None:
    """Fill an inclusive pixel box with `fill`, then SHARED diagonal lines aligned across boxes."""
    x0, y0, x1, y1 = box
    ImageDraw.Draw(image).rectangle(box, fill=fill)
    ys, xs = np.mgrid[y0 : y1 + 1, x0 : x1 + 1]  # [h, w]: absolute pixel coordinates, so stripes line up
    stripes = ((xs + ys) % HATCH < 2).astype(np.uint8) * 255
    image.paste(SHARED, (x0, y0, x1 + 1, y1 + 1), Image.fromarray(stripes, mode="L"))


def draw_pack_mask(
    engine: Any,
    prompts: Sequence[Any],
    path: str | os.PathLike[str],
    adapters: Sequence[str | None] | None = None,
    max_pixels: int = 1024,
    ids: Sequence[Any] | None = None,
) -> list[dict]:
    """Draw what one packed prefill pass of `prompts` attends to as a PNG, its segment table underneath.

    The mask is `side` pixels square, `side = min(max_pixels, max(T, 512))` for T packed tokens;
    x is the key position, y the query position, one colour per question, shared-prefix reads
    hatched; each question's id is written right of its rows. Returns the table.
    """
    if max_pixels < 16:
        raise ValueError(f"max_pixels={max_pixels!r} is too small; use at least 16")
    layout = layout_pack(engine, prompts, adapters, ids)
    rows, cu, num_tokens = _rows(layout), layout.batch.cu_seqlens_list, layout.batch.num_tokens
    side = min(max_pixels, max(num_tokens, MIN_SIDE))
    scale = side / num_tokens  # pixels per token

    def at(pos: int) -> int:
        return round(pos * scale)

    font = ImageFont.load_default(size=13)
    label_width = int(font.getlength(str(num_tokens)))
    id_width = int(max(font.getlength(_label(r)) for r in rows))
    left, top = PAD + LINE + label_width + 6, PAD + 3 * LINE  # room for titles and tick labels
    col_widths = [max(font.getlength(c), *(font.getlength(str(r[c])) for r in rows)) + 16 for c in COLUMNS]
    table_width = int(LINE + sum(col_widths))
    num_shared = sum(layout.shared)
    legend = ("hatched: a question reads a shared prefix block, computed once in these columns by an earlier question"
              if num_shared else "")  # nothing shared: nothing hatched to explain
    legend_width = int(PAD + LINE + font.getlength(legend) + PAD)
    width = max(left + side + 8 + id_width + PAD, PAD + table_width + PAD, legend_width)
    height = top + side + PAD + LINE * (len(rows) + 1 + bool(legend)) + PAD
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)

    for i, ranges in enumerate(layout.reads):  # reads first: where pixels merge, own triangles win
        row_box = (at(cu[i]), max(at(cu[i + 1]) - 1, at(cu[i])))
        for start, end in ranges:
            x0, x1 = at(start), max(at(end) - 1, at(start))
            _hatch(image, (left + x0, top + row_box[0], left + x1, top + row_box[1]), tint(colour(i)))
    for i, (start, end) in enumerate(zip(cu, cu[1:])):
        draw.polygon(_segment_polygon(start, end, scale, (left, top)), fill=colour(i))
    last_line = last_x = last_y = last_id = -(10**9)
    last_half = 0.0  # half the width of the last key label drawn
    ends = {end for ranges in layout.reads for _, end in ranges}  # where a shared prefix's keys end
    for boundary in sorted(set(cu) | ends):  # grid lines and tick labels, thinned where they would merge
        pixel, label, is_cu = at(boundary), str(boundary), boundary in cu
        if pixel - last_line >= 4:
            draw.line([(left + pixel, top), (left + pixel, top + side)], fill=GRID)
            if is_cu:  # queries are only ever split at segment boundaries
                draw.line([(left, top + pixel), (left + side, top + pixel)], fill=GRID)
            last_line = pixel
        half = font.getlength(label) / 2
        if pixel - last_x >= last_half + half + 6:
            draw.text((left + pixel, top - 4), label, fill=INK, font=font, anchor="mb")
            last_x, last_half = pixel, half
        if is_cu and pixel - last_y >= LINE:
            draw.text((left - 4, top + pixel), label, fill=INK, font=font, anchor="rm")
            last_y = pixel
    for i, row in enumerate(rows):  # ids right of each question's rows, skipped where they would overlap
        middle = (at(row["start"]) + at(row["end"])) // 2
        if middle - last_id >= LINE - 4:
            draw.text((left + side + 8, top + middle), _label(row), fill=colour(i), font=font, anchor="lm")
            last_id = middle
    draw.rectangle([left - 1, top - 1, left + side, top + side], outline=INK)

    title = f"{len(rows)} questions, {num_tokens} tokens computed in one packed pass"
    title += f", {num_shared} prompt tokens read from shared prefix blocks" if num_shared else ""
    draw.text((PAD, PAD), title, fill=INK, font=font)
    draw.text((left + side / 2, PAD + LINE), "key position", fill=INK, font=font, anchor="mt")
    axis = Image.new("RGB", (int(font.getlength("query position")) + 4, LINE), BACKGROUND)
    ImageDraw.Draw(axis).text((2, 0), "query position", fill=INK, font=font)
    rotated = axis.rotate(90, expand=True)
    image.paste(rotated, (PAD, top + max(0, (side - rotated.height) // 2)))

    y = top + side + PAD
    if legend:
        _hatch(image, (PAD, y + 3, PAD + 11, y + 14), tint(PALETTE[0]))
        draw.text((PAD + LINE, y), legend, fill=INK, font=font)
        y += LINE
    for r, line in enumerate([dict(zip(COLUMNS, COLUMNS))] + rows):
        if r:  # a colour swatch ties each row to its triangle
            draw.rectangle([PAD, y + 3, PAD + 11, y + 14], fill=colour(r - 1))
        x = float(PAD + LINE)
        for column, w in zip(COLUMNS, col_widths):  # names left-aligned, numbers right-aligned
            anchor, text_x = ("la", x) if column in TEXT_COLUMNS else ("ra", x + w - 16)
            draw.text((text_x, y), str(line[column]), fill=INK, font=font, anchor=anchor)
            x += w
        y += LINE
    image.save(path, format="PNG")
    return rows


def _label(row: dict[str, Any]) -> str:
    """What is written right of a question's rows: its id, and its adapter where it has one."""
    return str(row["id"]) if row["adapter"] == "base" else f"{row['id']} ({row['adapter']})"
