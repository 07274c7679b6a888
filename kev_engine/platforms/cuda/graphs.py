"""Decode passes replayed as CUDA graphs, one per row-count bucket.

Where this sits: `ModelRunner.forward`, for a pass that is decode rows only (one new token each, no
LoRA adapter) on the paged CUDA attention. A small pack's decode step is bound by kernel
launches, not arithmetic: hundreds of small kernels per layer. vLLM and SGLang capture the decode
forward once per batch-size bucket and replay it; Kev does the same, lazily, the first time a
bucket is needed.

Static buffers: a graph replays the same kernels on the same memory, so every input lives in
tensors allocated once per bucket (`static_pack`) and is copied in before each replay (`fill`):
token ids, positions, the slot each new key/value goes to, each row's block table and
`seqused_k`. A bucket of b rows serves B ≤ b live rows; the b − B padding rows read and write
one block the engine never hands out (`trash_block`), so they touch no question's memory, and
their logits are dropped. The kernel's `max_seqlen_k` is the model's context length: an upper
bound it only uses to size its work, the same at capture and at every replay.

A replay runs the kernels captured on the tensors captured, and no Python: the graphs are of Kev's
own model (`models`), whose weights stay where they were put when the engine started; a pass with
an adapter runs eagerly. The transformers fallback has no graphs: its modules may be hooked or
replaced at any time, and a replay would not see it.

Replay equals eager bitwise when the engine is batch-invariant (its products and norms do not
depend on the row count, attention keeps `num_splits=1`): a padded row changes nothing of a real
one. On a CPU engine (tests) the same static path runs eagerly (`capture=False`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...core.blocks import blocks_for
from ...model.pack import PackedBatch
from .varlen import PagedTables

WARMUP_PASSES = 2  # before a capture: lazy inits (cuBLAS handles, Triton compiles) must not be captured


def buckets(max_rows: int) -> list[int]:
    """Row counts graphs are captured for: 1, 2, 4, ... up to the first power of two ≥ max_rows."""
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows} is not allowed; use an integer >= 1")
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes


def bucket_for(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds `num_rows` rows, or None when none does."""
    return next((size for size in sizes if size >= num_rows), None)


def why_not_graph(batch: PackedBatch) -> str | None:
    """Why this pass runs eagerly, or None when a decode graph can replay it."""
    if not isinstance(batch.attention, PagedTables):
        return "the pack has no paged tables"
    if batch.num_tokens != batch.num_segments:
        return "a prefill chunk (more than one new token in a segment)"
    if any(adapter is not None for adapter in batch.adapters):
        return "a LoRA adapter's rows (their routing changes every pass)"
    if batch.logits_rows != [(i, i + 1) for i in range(batch.num_segments)]:
        return "a row without exactly one logits row"
    return None


def static_pack(rows: int, block_size: int, max_context: int, device: torch.device) -> PackedBatch:
    """A pack of `rows` decode rows whose tensors are the bucket's static buffers (zeros until filled)."""
    def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    width = blocks_for(max_context, block_size)
    return PackedBatch(
        input_ids=zeros(rows),
        position_ids=zeros(rows),
        cu_seqlens=torch.arange(rows + 1, dtype=torch.int32, device=device),  # one new token per row
        cu_seqlens_list=list(range(rows + 1)),
        past_lens=[0] * rows,  # host-side values are only read by CPU paths; the kernels read the tensors
        max_seqlen=1,
        logits_indices=torch.arange(rows, device=device),
        logits_rows=[(i, i + 1) for i in range(rows)],
        request_ids=list(range(rows)),
        adapters=[None] * rows,
        block_tables=[[] for _ in range(rows)],
        prompt_rows=[0] * rows,  # the GPU's products compute every row one way
        slot_blocks=zeros(rows),
        slot_offsets=zeros(rows),
        attention=PagedTables(
            cu_seqlens_k=zeros(rows + 1, dtype=torch.int32),
            max_seqlen_k=max_context,
            block_table=zeros(rows, width, dtype=torch.int32),
            seqused_k=zeros(rows, dtype=torch.int32),
        ),
    )


def fill(static: PackedBatch, live: PackedBatch | None, trash_block: int) -> None:
    """Copy a live decode pack into a bucket's buffers; rows past it become padding on `trash_block`.

    `live=None` makes every row padding (the warm-up and capture passes)."""
    num_live = 0 if live is None else live.num_segments
    tables = static.attention
    assert isinstance(tables, PagedTables) and static.slot_blocks is not None and static.slot_offsets is not None
    if live is not None:
        live_tables = live.attention
        assert isinstance(live_tables, PagedTables) and live.slot_blocks is not None and live.slot_offsets is not None
        if num_live > static.num_segments:
            raise ValueError(f"{num_live} decode rows do not fit a bucket of {static.num_segments}")
        width = live_tables.block_table.shape[1]
        if width > tables.block_table.shape[1]:
            raise ValueError(f"a row reads {width} blocks; the graph's block table holds "
                             f"{tables.block_table.shape[1]} (the model's context length)")
        static.input_ids[:num_live].copy_(live.input_ids)
        static.position_ids[:num_live].copy_(live.position_ids)
        static.slot_blocks[:num_live].copy_(live.slot_blocks)
        static.slot_offsets[:num_live].copy_(live.slot_offsets)
        tables.seqused_k[:num_live].copy_(live_tables.seqused_k)
        tables.block_table[:num_live, :width].copy_(live_tables.block_table)  # entries past width: never read
    # padding rows: token 0 at position 0, written to and read from slot 0 of the trash block
    static.input_ids[num_live:].zero_()
    static.position_ids[num_live:].zero_()
    static.slot_blocks[num_live:].fill_(trash_block)
    static.slot_offsets[num_live:].zero_()
    tables.seqused_k[num_live:].fill_(1)
    tables.block_table[num_live:, :1].fill_(trash_block)
    torch.cumsum(tables.seqused_k, 0, dtype=torch.int32, out=tables.cu_seqlens_k[1:])


@dataclass
class StaticDecode:
    """One bucket: its static pack and, once captured, the graph and the logits it writes."""

    batch: PackedBatch
    graph: Any = None  # torch.cuda.CUDAGraph
    logits: torch.Tensor | None = None  # [rows, vocab] fp32, rewritten by every replay


class DecodeGraphs:
    """The engine's decode graphs: `run(batch)` for a pass that `why_not_graph` accepts."""

    def __init__(
        self,
        forward: Callable[[PackedBatch], torch.Tensor],
        kv: Any,
        max_rows: int,
        max_context: int,
        trash_block: int,
        capture: bool,
    ) -> None:
        """`forward`: Kev's model on a pack → logits [rows, vocab]; `capture`: record CUDA graphs
        (False: run the same static path eagerly, as on a CPU)."""
        self.forward = forward
        self.kv = kv
        self.sizes = buckets(max_rows)
        self.max_context = max_context
        self.trash_block = trash_block
        self.capture = capture
        self.device = kv.keys[0].device
        self.statics: dict[int, StaticDecode] = {}
        self.replays = 0  # passes served by a bucket (replayed, or run statically when not capturing)
        self._pool: Any = None  # one CUDA memory pool shared by every bucket's graph

    def fits(self, batch: PackedBatch) -> bool:
        return why_not_graph(batch) is None and bucket_for(batch.num_segments, self.sizes) is not None

    @property
    def captured(self) -> list[int]:
        """The buckets with a graph (or, without capture, with static buffers)."""
        return sorted(self.statics)

    def run(self, batch: PackedBatch) -> torch.Tensor:
        """Logits [B, vocab] fp32 of a decode pass of B rows, through its bucket."""
        rows = bucket_for(batch.num_segments, self.sizes)
        assert rows is not None and why_not_graph(batch) is None
        static = self.statics.get(rows)
        if static is None:
            static = self.statics[rows] = self._prepare(rows)
        fill(static.batch, batch, self.trash_block)
        if static.graph is not None:
            static.graph.replay()
            logits = static.logits
        else:
            logits = self.forward(static.batch)
        self.replays += 1
        assert logits is not None
        return logits[: batch.num_segments].clone()  # the next replay rewrites the static output

    def _prepare(self, rows: int) -> StaticDecode:
        static = StaticDecode(static_pack(rows, self.kv.block_size, self.max_context, self.device))
        if self.capture:
            self._capture(static)
        return static

    def _capture(self, static: StaticDecode) -> None:
        """Warm up on a side stream, then record the forward (torch.cuda.graphs' recipe)."""
        fill(static.batch, None, self.trash_block)  # all padding: warm-up passes write only the trash block
        rows = static.batch.num_segments
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_PASSES):
                    self.forward(static.batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA call (a caller's tensor) must not break this capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                static.logits = self.forward(static.batch)
        except Exception as exc:
            raise RuntimeError(
                f"capturing the CUDA graph of a {rows}-row decode pass failed ({type(exc).__name__}: {exc}); "
                "Engine(cuda_graphs=False) runs decode passes eagerly"
            ) from exc
        static.graph = graph
