"""The model runner: a pass's chunks → one pack → the model → logits, on the engine's attention backend.

Where this sits: `Stepper.step` between scheduling and sampling: it runs the scheduler's plan.
It is the only code that touches the model and its KV memory (new blocks cleared, forked blocks
copied, the pass written): the platform's attention backend bound to the pool, each
segment's LoRA adapter routed to its rows, and which implementation computes: Kev's own model
(`models`: its forward, or its decode passes replayed as the platform's graphs) or the
transformers fallback (`forward.run_model`). A pass of Kev's model may run in slices of layers
(`begin`, `advance`, `end`) with other passes between them (`Stepper`). `lock` is held for every
forward and slice; adapters install and the model is given back only between them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from .adapters.pool import AdapterPool
from .core.plan import Chunk, Plan
from .model.forward import run_model
from .model.pack import PackedBatch, Segment, pack
from .models import DecoderModel
from .models.llama import PassState
from .platforms.base import AttentionBackend

if TYPE_CHECKING:
    from .platforms.cuda.graphs import DecodeGraphs


class ModelRunner:
    def __init__(self, model: Any, backend: AttentionBackend, adapters: AdapterPool, *, device: torch.device,
                 graphs: DecodeGraphs | None = None) -> None:
        """`model`: Kev's (`models.DecoderModel`) or a transformers model (the fallback); `graphs`:
        the platform's decode graphs of Kev's model, replayed for the passes they fit."""
        self.model = model
        self.backend = backend
        self.pool = backend.pool
        self.device = device
        self.adapters = adapters
        self.lock = threading.Lock()  # one forward at a time; adapters install between passes
        self.graphs = graphs
        self.own = isinstance(model, DecoderModel)

    def run(self, plan: Plan) -> tuple[PackedBatch, torch.Tensor]:
        """A plan's pass, start to end: its pack and fp32 logits [K, vocab]."""
        batch = self.prepare(plan)
        return batch, self.forward(batch, plan.resident)

    def prepare(self, plan: Plan) -> PackedBatch:
        """A plan's pack, its new KV blocks cleared first where the backend reads whole blocks."""
        self.backend.new_blocks(plan.fresh)  # passes never overlap: no forward reads them meanwhile
        return self.pack(plan.chunks)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """KV blocks copied (source, target) for samples forked from a prefill (`Scheduler.fork`),
        before the next pass writes into the copies."""
        self.pool.copy_blocks(copies)

    def pack(self, chunks: list[Chunk]) -> PackedBatch:
        """Each chunk's tokens after what its request has computed, with its blocks and adapter."""
        segments = []
        for chunk in chunks:
            request, start = chunk.request, chunk.request.num_computed
            segments.append(Segment(
                request_id=request.request_id,
                token_ids=request.all_ids[start : start + chunk.num_tokens - len(chunk.draft)] + list(chunk.draft),
                past_len=start,
                needs_logits=chunk.needs_logits,
                block_ids=request.blocks.block_ids,
                adapter=request.adapter,
                all_logits=request.all_logits or bool(chunk.draft),  # a draft's every row is drawn from
                prompt_rows=max(0, min(chunk.num_tokens, len(request.prompt_ids) - start)),
            ))
        return pack(segments, self.device, self.backend)

    def resident_adapters(self) -> dict[str, Any]:
        """The adapters on the device (called under the engine's lock, where adapters are admitted)."""
        return self.adapters.resident_map()

    def forward(self, batch: PackedBatch, resident: dict[str, Any]) -> torch.Tensor:
        """The model on one pack, each segment's adapter (`resident`: the adapters on the device) routed to its rows."""
        with self.lock:
            self.adapters.router.set_routes(batch.cu_seqlens_list, batch.adapters, resident)
            try:
                if not self.own:
                    return run_model(self.model, batch, self.backend)
                if self.graphs is not None and self.graphs.fits(batch):
                    return self.graphs.run(batch)
                return self.model.forward(batch, self.backend, self.adapters.router.routes)
            finally:
                self.adapters.router.clear()

    @property
    def num_layers(self) -> int | None:
        """The layers a pass can pause between (Kev's own model), or None: the transformers
        fallback runs each pass whole."""
        return len(self.model.layers) if self.own else None

    def begin(self, batch: PackedBatch, resident: dict[str, Any]) -> PassState:
        """A pass of Kev's model that runs in slices (`advance`, `end`); other passes may run between them."""
        with self.lock:
            self.adapters.router.set_routes(batch.cu_seqlens_list, batch.adapters, resident)
            try:
                return self.model.begin(batch, self.backend, list(self.adapters.router.routes))
            finally:
                self.adapters.router.clear()

    def advance(self, state: PassState, layers: int) -> None:
        with self.lock:
            self.model.advance(state, layers)

    def end(self, state: PassState) -> torch.Tensor:
        """fp32 logits [K, vocab] of a pass whose layers have all run."""
        with self.lock:
            return self.model.end(state)
