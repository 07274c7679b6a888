"""The model runner: a pass's chunks → one pack → the model → logits, on the engine's attention backend.

Where this sits: `Stepper.step` between scheduling and sampling. It owns what touches the model
and its KV memory during a pass: the platform's attention backend bound to the pool, each
segment's LoRA adapter routed to its rows, and the platform's own way to run a pass where it
has one (decode graphs; a pass of Kev's calls alone, without the model's forward).
`lock` is held for every forward; adapters install and the model is given back only between passes.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from ..adapters.pool import AdapterPool
from ..core.schedule import Chunk
from ..platforms.base import AttentionBackend
from .forward import run_model
from .pack import PackedBatch, Segment, pack


class Graphs(Protocol):
    """A platform's own way to run the passes it fits: replayed decode graphs
    (`Platform.decode_graphs`) or the model's pass as the platform's calls alone
    (`Platform.model_forward`); `run` returns what `run_model` would."""

    def fits(self, batch: PackedBatch) -> bool: ...

    def run(self, batch: PackedBatch) -> torch.Tensor: ...


class ModelRunner:
    def __init__(self, model: Any, backend: AttentionBackend, adapters: AdapterPool, *, device: torch.device,
                 graphs: Graphs | None = None, direct: Graphs | None = None) -> None:
        """`graphs`: the platform's decode graphs, replayed for the passes they fit; `direct`: its
        pass of the model without the model's forward, for the passes it fits."""
        self.model = model
        self.backend = backend
        self.pool = backend.pool
        self.device = device
        self.adapters = adapters
        self.lock = threading.Lock()  # one forward at a time; adapters install between passes
        self.graphs = graphs
        self.direct = direct

    def pack(self, chunks: list[Chunk]) -> PackedBatch:
        """Each chunk's tokens after what its request has computed, with its blocks and adapter."""
        segments = []
        for chunk in chunks:
            request, start = chunk.request, chunk.request.num_computed
            segments.append(Segment(
                request_id=request.request_id,
                token_ids=request.all_ids[start : start + chunk.num_tokens],
                past_len=start,
                needs_logits=chunk.needs_logits,
                block_ids=request.blocks.block_ids,
                adapter=request.adapter,
                all_logits=request.all_logits,
            ))
        return pack(segments, self.device, self.backend)

    def forward(self, batch: PackedBatch, resident: dict[str, Any]) -> torch.Tensor:
        """The model on one pack, each segment's adapter (`resident`: the adapters on the device) routed to its rows."""
        with self.lock:
            self.adapters.router.set_routes(batch.cu_seqlens_list, batch.adapters, resident)
            try:
                if self.graphs is not None and self.graphs.fits(batch):
                    return self.graphs.run(batch)
                if self.direct is not None and self.direct.fits(batch):
                    return self.direct.run(batch)
                return run_model(self.model, batch, self.backend)
            finally:
                self.adapters.router.clear()
