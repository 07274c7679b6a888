"""Decode attention alone: Kev's batch-invariant attention kernel, the compiled decode kernel of the
non-invariant path and the torch path, alternating in one process.

Why a separate script: end-to-end walls and the decode-step ratio in bench_engine.py drift by
tens of percent on a shared VM between the moments they are measured; this times only the
attention of one decode step (every layer) for both paths, alternately, on the same pool, so
the ratio between them is what the code does. Shapes are the embedded model's (30 layers, 3 kv
heads, head size 64, 9 query heads, fp32, 32-token blocks).

  RAG-16  16 rows with the RAG-16 prompts' token counts (each its own blocks, in pool order)
  DOC-QA  20 rows reading one 1,490-token document's blocks, then a private suffix each

Usage: python benchmarks/bench_decode_attention.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import load_rag, rag_messages  # noqa: E402

from kev_engine import Engine  # noqa: E402
from kev_engine.core.blocks import blocks_for  # noqa: E402
from kev_engine.model.pack import Segment, pack  # noqa: E402
from kev_engine.platforms.cpu.fast import FastBackend  # noqa: E402
from kev_engine.platforms.cpu.kernels import load_kernels  # noqa: E402
from kev_engine.platforms.torch_ops import TorchBackend  # noqa: E402

LAYERS, KV_HEADS, HEADS, DIM, BLOCK = 30, 3, 9, 64, 32
DOC_TOKENS, DOC_SUFFIX = 1490, 20


def rag_tables() -> list[tuple[list[int], int]]:
    """(block ids, tokens read) per row: the RAG-16 prompts' lengths plus 24 generated tokens."""
    engine = Engine.from_pretrained(cpu_kernels="torch")
    lengths = [len(engine.encode(rag_messages(item))) + 24 for item in load_rag()]
    engine.close()
    rows, next_id = [], 0
    for n in lengths:
        count = blocks_for(n, BLOCK)
        rows.append((list(range(next_id, next_id + count)), n))
        next_id += count
    return rows


def doc_tables() -> list[tuple[list[int], int]]:
    shared = blocks_for(DOC_TOKENS, BLOCK) - 1  # whole blocks only are shared
    rows, next_id = [], shared
    for _ in range(20):
        n = shared * BLOCK + DOC_SUFFIX + 24
        own = blocks_for(n, BLOCK) - shared
        rows.append((list(range(shared)) + list(range(next_id, next_id + own)), n))
        next_id += own
    return rows


def time_paths(rows: list[tuple[list[int], int]], repeat: int) -> dict[str, float]:
    num_blocks = 1 + max(b for table, _ in rows for b in table)
    torch.manual_seed(0)
    keys = [torch.randn(num_blocks, KV_HEADS, BLOCK, DIM) for _ in range(LAYERS)]
    values = [torch.randn(num_blocks, KV_HEADS, BLOCK, DIM) for _ in range(LAYERS)]
    query = torch.randn(len(rows), HEADS, DIM)
    segments = [Segment(i, [1], n - 1, True, block_ids=table) for i, (table, n) in enumerate(rows)]
    kernels = load_kernels()
    pool = SimpleNamespace(block_size=BLOCK, keys=keys, values=values)
    backends = {"compiled": FastBackend(kernels).bind(pool), "torch": TorchBackend().bind(pool)}
    layouts = {path: pack(segments, backend=backend).attention for path, backend in backends.items()}
    outputs = {path: backend.decode_rows(query, layouts[path], 0, None) for path, backend in backends.items()}
    # the exact pool keeps each block's keys transposed; one row per segment, past = its tokens before
    keys_t = [k.transpose(2, 3).contiguous() for k in keys]
    tables = torch.tensor([t + [0] * (max(len(x) for x, _ in rows) - len(t)) for t, _ in rows], dtype=torch.int32)
    cu = torch.arange(len(rows) + 1, dtype=torch.int32)
    past = torch.tensor([n - 1 for _, n in rows], dtype=torch.int32)

    def exact(layer: int) -> torch.Tensor:
        return kernels.paged_attention(query, keys_t[layer], values[layer], tables, cu, past, DIM**-0.5)

    outputs["exact"] = exact(0)
    difference = max((outputs[p] - outputs["torch"]).abs().max().item() for p in ("compiled", "exact"))
    steps = {path: (lambda layout=layouts[path], backend=backend: [backend.decode_rows(query, layout, layer, None)
                                                                   for layer in range(LAYERS)])
             for path, backend in backends.items()}
    steps["exact"] = lambda: [exact(layer) for layer in range(LAYERS)]
    runs: dict[str, list[float]] = {path: [] for path in steps}
    for _ in range(repeat):  # alternate, so drift hits every path alike
        for path, step in steps.items():
            runs[path].append(min(timeit.repeat(step, number=1, repeat=3)))
    medians = {path: 1000 * statistics.median(times) for path, times in runs.items()}
    # keys + values of every row's tokens, all layers; shared blocks counted once per reader
    kv_bytes = sum(n for _, n in rows) * KV_HEADS * DIM * 4 * 2 * LAYERS
    return {**medians, "max_abs_difference": difference, "kv_mb_read": kv_bytes / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    lines = [f"# Decode attention, one step (30 layers), fp32, {torch.get_num_threads()} threads, "
             f"torch {torch.__version__}; median of {args.repeat} alternating runs (each the best of 3)", "",
             "| workload | rows | KV attended per step MB | exact (batch-invariant) ms | compiled decode kernel ms | "
             "torch path ms | exact / compiled | max abs difference to torch |", "|---|---|---|---|---|---|---|---|"]
    for name, rows in (("RAG-16", rag_tables()), ("DOC-QA", doc_tables())):
        r = time_paths(rows, args.repeat)
        lines.append(f"| {name} | {len(rows)} | {r['kv_mb_read']:.0f} | {r['exact']:.1f} | {r['compiled']:.1f} | "
                     f"{r['torch']:.1f} | {r['exact'] / r['compiled']:.2f}x | {r['max_abs_difference']:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).resolve().parent / "results" / "bench_decode_attention.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
