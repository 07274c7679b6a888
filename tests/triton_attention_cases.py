"""Cases for Kev's Triton paged attention, run by tests/test_triton_attention.py under Triton's interpreter.

`python tests/triton_attention_cases.py CASE` with TRITON_INTERPRET=1 (set before Triton compiles
anything, hence a process of its own); prints "CASE ok". Every pool byte nobody wrote is NaN, so
a read past a segment's own keys shows.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from kev_engine.core.blocks import blocks_for
from kev_engine.platforms.cuda import triton_attention

# (cached tokens, new tokens): a prefill, decode rows after short and long contexts, a chunk
# continuing a prefix across block boundaries, a context over several key blocks of 64
SEGMENTS = [(0, 7), (5, 1), (0, 1), (37, 4), (130, 1), (200, 33), (63, 2)]


class Pool:
    """A paged pool with the segments' blocks scattered through it, NaN wherever nothing was written."""

    def __init__(self, segments: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block: int,
                 dtype: torch.dtype, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = [past + new for past, new in segments]
        num_blocks = sum(blocks_for(n, block) for n in lengths) + 3
        order = torch.randperm(num_blocks, generator=generator).tolist()
        self.keys = torch.full((num_blocks, block, kv_heads, head_dim), math.nan, dtype=dtype)
        self.values = torch.full_like(self.keys, math.nan)
        self.tables, cursor = [], 0
        for n in lengths:
            blocks = order[cursor: cursor + blocks_for(n, block)]
            cursor += len(blocks)
            self.tables.append(blocks)
            for position in range(n):  # written positions only
                self.keys[blocks[position // block], position % block] = torch.randn(
                    kv_heads, head_dim, generator=generator).to(dtype)
                self.values[blocks[position // block], position % block] = torch.randn(
                    kv_heads, head_dim, generator=generator).to(dtype)
        self.block = block
        self.query = torch.randn(sum(new for _, new in segments), heads, head_dim, generator=generator).to(dtype)

    def attend(self, rows: list[tuple[int, int, int]], query: torch.Tensor, **kwargs) -> torch.Tensor:
        """The kernel over `rows`, (table, cached tokens, new tokens) each, `query` [T, H, D] their new tokens."""
        news = [new for _, _, new in rows]
        cu = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int32)
        used = torch.tensor([past + new for _, past, new in rows], dtype=torch.int32)
        tables = [self.tables[i] for i, _, _ in rows]
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        return triton_attention.paged_attention(query, self.keys, self.values, cu, used, table, max(news), None,
                                                **kwargs)

    def reference(self, segments: list[tuple[int, int]]) -> torch.Tensor:
        """[T, H, D] float32: each segment's new queries over its own keys, causal from its last position back."""
        out, start = [], 0
        for i, (past, new) in enumerate(segments):
            m = past + new
            k = self.keys[self.tables[i]].flatten(0, 1)[:m].float().transpose(0, 1)
            v = self.values[self.tables[i]].flatten(0, 1)[:m].float().transpose(0, 1)
            q = self.query[start: start + new].float().transpose(0, 1)
            mask = torch.ones(new, m, dtype=torch.bool).tril(diagonal=m - new)
            out.append(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                      enable_gqa=True)[0].transpose(0, 1))
            start += new
        return torch.cat(out)


def rows_of(segments: list[tuple[int, int]], which: list[int] | None = None) -> list[tuple[int, int, int]]:
    """(table, cached, new) of the segments `which` (all of them by default), each on its own table."""
    return [(i, *segments[i]) for i in (range(len(segments)) if which is None else which)]


def starts(segments: list[tuple[int, int]]) -> list[int]:
    return [0] + torch.tensor([new for _, new in segments]).cumsum(0).tolist()


def matches_reference() -> None:
    """Grouped heads of 1, 2, 3 and 7 query heads per key head, head_dim 16, 64 and 80 (not a power
    of two), blocks of 5, 16 and 32 tokens, float32 and bfloat16, both forms of the products."""
    shapes = [(4, 4, 16, 16), (4, 2, 64, 5), (6, 2, 80, 32), (14, 2, 16, 16)]
    for heads, kv_heads, head_dim, block in shapes:
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            pool = Pool(SEGMENTS, heads, kv_heads, head_dim, block, dtype)
            expected = pool.reference(SEGMENTS)
            for dot in (False, True):
                out = pool.attend(rows_of(SEGMENTS), pool.query, dot=dot)
                assert out.dtype == dtype and out.shape == pool.query.shape and torch.isfinite(out).all()
                where = f"{heads}/{kv_heads} heads, d={head_dim}, block {block}, {dtype}, dot={dot}"
                torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance,
                                           msg=lambda m, where=where: f"{where}: {m}")


def same_alone_as_packed() -> None:
    """Each segment's rows have the same bits alone as among the others, and a prompt's rows the
    same computed whole or in chunks continuing its cache; the control (key blocks sized by the
    pass) differs from alone in the same comparison."""
    for dtype in (torch.float32, torch.bfloat16):
        pool = Pool(SEGMENTS, 6, 2, 64, 16, dtype)
        packed = pool.attend(rows_of(SEGMENTS), pool.query)
        control = pool.attend(rows_of(SEGMENTS), pool.query, shape_dependent=True)
        cu = starts(SEGMENTS)
        control_differs = False
        for i in range(len(SEGMENTS)):
            alone = pool.attend(rows_of(SEGMENTS, [i]), pool.query[cu[i]: cu[i + 1]])
            assert torch.equal(alone, packed[cu[i]: cu[i + 1]]), f"segment {i} {SEGMENTS[i]} {dtype}"
            control_differs |= not torch.equal(alone, control[cu[i]: cu[i + 1]])
        assert control_differs, f"the shape-dependent control gave the same bits ({dtype}): the test could not fail"

        # segment 5 (200 cached, 33 new) as chunks of 10, 1 and 22 continuing its own cache
        past, new = SEGMENTS[5]
        whole = packed[cu[5]: cu[6]]
        done = 0
        for size in (10, 1, 22):
            part = pool.attend([(5, past + done, size)], pool.query[cu[5] + done: cu[5] + done + size])
            assert torch.equal(part, whole[done: done + size]), f"chunk at {done} of {size} ({dtype})"
            done += size


def padding_rows_change_nothing() -> None:
    """A decode pass as a graph bucket runs it: live rows, then padding rows on one trash block
    (one key, seen by position 0): the live rows' bits are those of the pass without padding."""
    decode = [(40, 1), (3, 1), (99, 1)]
    pool = Pool(decode + [(0, 1)] * 5, 4, 2, 16, 16, torch.bfloat16)
    live = pool.attend(rows_of(decode), pool.query[:3])
    bucket = pool.attend(rows_of(decode) + [(3, 0, 1)] * 5, pool.query)
    assert torch.equal(bucket[:3], live)


CASES = {f.__name__: f for f in (matches_reference, same_alone_as_packed, padding_rows_change_nothing)}

if __name__ == "__main__":
    assert triton_attention.INTERPRETED, "run with TRITON_INTERPRET=1"
    CASES[sys.argv[1]]()
    print(sys.argv[1], "ok")
