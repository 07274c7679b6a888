"""The model runner: a pass's chunks → one pack → the model → logits, on the engine's attention backend.

Where this sits: `Engine.step` between scheduling and sampling. It owns what touches the model
and its KV memory during a pass: the attention backend bound to the pool (`backends`), each
segment's LoRA adapter routed to its rows, and the decode CUDA graphs where the backend is the
paged CUDA kernel. `lock` is held for every forward; adapters install and the model is given
back only between passes.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from .adapters import AdapterPool
from .backends.base import AttentionBackend
from .backends.cuda import CudaBackend
from .backends.cuda_graphs import DecodeGraphs
from .forward import run_model
from .pack import PackedBatch, Segment, pack
from .schedule import Chunk


class ModelRunner:
    def __init__(self, model: Any, backend: AttentionBackend, adapters: AdapterPool, *, device: torch.device,
                 cuda_graphs: bool, max_rows: int, max_context: int) -> None:
        """`cuda_graphs`: decode passes replay graphs (`backends.cuda_graphs`) when the backend is CUDA's."""
        self.model = model
        self.backend = backend
        self.pool = backend.pool
        self.device = device
        self.adapters = adapters
        self.lock = threading.Lock()  # one forward at a time; adapters install between passes
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and isinstance(backend, CudaBackend):
            trash = self.pool.reserve_last_block()
            self.pool.zero([trash])
            self.graphs = DecodeGraphs(functools.partial(run_model, model, backend=backend), self.pool, max_rows,
                                       max_context, trash, capture=device.type == "cuda")

    def pack(self, chunks: list[Chunk]) -> PackedBatch:
        """Each chunk's tokens after what its request has computed, with its blocks and adapter."""
        segments = []
        for chunk in chunks:
            request, start = chunk.request, chunk.request.num_computed
            segments.append(Segment(
                request_id=request.request_id,
                token_ids=request.all_ids[start : start + chunk.num_tokens],
                past_len=start,
                needs_logits=chunk.samples,
                block_ids=request.blocks.block_ids,
                adapter=request.adapter,
                all_logits=request.logits_only,
            ))
        return pack(segments, self.device, self.backend)

    def forward(self, batch: PackedBatch, resident: dict[str, Any]) -> torch.Tensor:
        """The model on one pack, each segment's adapter (`resident`: the adapters on the device) routed to its rows."""
        with self.lock:
            self.adapters.router.set_routes(batch.cu_seqlens_list, batch.adapters, resident)
            try:
                if self.graphs is not None and self.graphs.fits(batch):
                    return self.graphs.run(batch)
                return run_model(self.model, batch, self.backend)
            finally:
                self.adapters.router.clear()
