"""Seeing a pack: which tokens of one packed prefill pass may attend to which.

A debugging aid beside the flow (tokenize → pack), not part of it: the prompts are encoded
with `engine.encode` and laid out by the real `pack()`, and the picture is drawn from that
pack's `cu_seqlens_list`, so what you see is the segment layout the attention is given.
Query i may attend to key j only when both lie in the same segment and j <= i: one lower
triangle per segment on the diagonal, nothing anywhere else. The mask is never built as a
dense T×T array; each triangle is drawn as one polygon in scaled pixel coordinates.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from .errors import InvalidRequestError
from .pack import PackedBatch, Segment, pack

BACKGROUND = (255, 255, 255)  # masked out: no attention
GRID = (190, 190, 190)
INK = (30, 30, 30)
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
MIN_SIDE = 512  # small packs are scaled up to this, so one token is several pixels wide
PAD, LINE = 12, 18
COLUMNS = ("question", "adapter", "start", "end", "tokens")


def _pack_prompts(engine: Any, prompts: Sequence[Any], adapters: Sequence[str | None] | None) -> PackedBatch:
    """Encode each prompt alone and pack them as one prefill pass (what `prompt_logits` runs)."""
    if not prompts:
        raise ValueError("no prompts to pack; give at least one")
    if adapters is None:
        adapters = [None] * len(prompts)
    if len(adapters) != len(prompts):
        raise ValueError(f"got {len(adapters)} adapters for {len(prompts)} prompts; give one per prompt or None")
    segments = []
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        try:
            ids = engine.encode(prompt)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"question {i}: {exc}") from exc
        segments.append(Segment(i, ids, 0, needs_logits=True, adapter=adapter))
    return pack(segments)


def _rows(batch: PackedBatch) -> list[dict[str, Any]]:
    cu = batch.cu_seqlens_list
    return [
        {"question": qid, "adapter": adapter or "base", "start": start, "end": end, "tokens": end - start}
        for qid, adapter, start, end in zip(batch.request_ids, batch.adapters, cu, cu[1:])
    ]


def segment_table(engine: Any, prompts: Sequence[Any], adapters: Sequence[str | None] | None = None) -> list[dict]:
    """One row per question: where its tokens sit in the packed pass, `[start, end)`."""
    return _rows(_pack_prompts(engine, prompts, adapters))


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The segment table as aligned text: names left-aligned, numbers right-aligned."""
    cells = [list(COLUMNS)] + [[str(row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) if c == "adapter" else cell.rjust(w) for c, cell, w in zip(COLUMNS, line, widths))
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


def draw_pack_mask(
    engine: Any,
    prompts: Sequence[Any],
    path: str | os.PathLike[str],
    adapters: Sequence[str | None] | None = None,
    max_pixels: int = 1024,
) -> list[dict]:
    """Draw the pack's block-diagonal causal mask as a PNG, its segment table underneath.

    The mask is `side` pixels square, `side = min(max_pixels, max(T, 512))` for T packed tokens;
    x is the key position, y the query position, one colour per question. Returns the table.
    """
    if max_pixels < 16:
        raise ValueError(f"max_pixels={max_pixels!r} is too small; use at least 16")
    batch = _pack_prompts(engine, prompts, adapters)
    rows, cu, num_tokens = _rows(batch), batch.cu_seqlens_list, batch.num_tokens
    side = min(max_pixels, max(num_tokens, MIN_SIDE))
    scale = side / num_tokens  # pixels per token

    font = ImageFont.load_default(size=13)
    label_width = int(font.getlength(str(num_tokens)))
    left, top = PAD + LINE + label_width + 6, PAD + 3 * LINE  # room for titles and tick labels
    col_widths = [max(font.getlength(c), *(font.getlength(str(r[c])) for r in rows)) + 16 for c in COLUMNS]
    table_width = int(LINE + sum(col_widths))
    width = max(left + side + PAD, PAD + table_width + PAD)
    height = top + side + PAD + LINE * (len(rows) + 1) + PAD
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)

    for i, (start, end) in enumerate(zip(cu, cu[1:])):
        draw.polygon(_segment_polygon(start, end, scale, (left, top)), fill=PALETTE[i % len(PALETTE)])
    last_line = last_x = last_y = -(10**9)
    last_half = 0.0  # half the width of the last key label drawn
    for boundary in cu:  # grid lines and tick labels at segment boundaries, thinned where they would merge
        pixel, label = round(boundary * scale), str(boundary)
        if pixel - last_line >= 4:
            draw.line([(left + pixel, top), (left + pixel, top + side)], fill=GRID)
            draw.line([(left, top + pixel), (left + side, top + pixel)], fill=GRID)
            last_line = pixel
        half = font.getlength(label) / 2
        if pixel - last_x >= last_half + half + 6:
            draw.text((left + pixel, top - 4), label, fill=INK, font=font, anchor="mb")
            last_x, last_half = pixel, half
        if pixel - last_y >= LINE:
            draw.text((left - 4, top + pixel), label, fill=INK, font=font, anchor="rm")
            last_y = pixel
    draw.rectangle([left - 1, top - 1, left + side, top + side], outline=INK)

    title = f"{len(rows)} questions, {num_tokens} tokens, one packed pass"
    draw.text((PAD, PAD), title, fill=INK, font=font)
    draw.text((left + side / 2, PAD + LINE), "key position", fill=INK, font=font, anchor="mt")
    axis = Image.new("RGB", (int(font.getlength("query position")) + 4, LINE), BACKGROUND)
    ImageDraw.Draw(axis).text((2, 0), "query position", fill=INK, font=font)
    rotated = axis.rotate(90, expand=True)
    image.paste(rotated, (PAD, top + max(0, (side - rotated.height) // 2)))

    y = top + side + PAD
    for r, line in enumerate([dict(zip(COLUMNS, COLUMNS))] + rows):
        if r:  # a colour swatch ties each row to its triangle
            draw.rectangle([PAD, y + 3, PAD + 11, y + 14], fill=PALETTE[(r - 1) % len(PALETTE)])
        x = float(PAD + LINE)
        for column, w in zip(COLUMNS, col_widths):  # names left-aligned, numbers right-aligned
            anchor, text_x = ("la", x) if column == "adapter" else ("ra", x + w - 16)
            draw.text((text_x, y), str(line[column]), fill=INK, font=font, anchor=anchor)
            x += w
        y += LINE
    image.save(path, format="PNG")
    return rows
