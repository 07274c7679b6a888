"""The platform seam: how an engine computes on its device, and who keeps its keys/values.

`Platform` is everything device-specific an engine needs, chosen once in `Engine.__init__`
(`platforms.choose`): the ops Kev's own model computes with (`ops`), what it installs on a
transformers model on the fallback path (Linear products, elementwise work), its attention
backend, the LoRA deltas' products there, whether it runs batch-invariant, decode graphs, the
default KV budget and pass duration. Nothing outside `platforms/` asks which device or kernel runs.

`AttentionBackend`, the platform's attention: chosen with it, it allocates the
engine's KV pool in its own layout (`allocate`) and is then bound to it. Every pass, `pack` asks
it for the pass's attention metadata (`plan`: plain data, a field of the `PackedBatch`), and
`attention.kev_attention` hands it each layer's new keys/values (`write`) and queries
(`attend`). The model's forward carries the pack and the backend (`forward.run_model`); nothing
else in the engine knows which kernel runs or how a block is laid out.

    backend      layout of a block (keys │ values)       kernels
    "torch"      [kvH, bs, D] │ [kvH, bs, D]            torch's SDPA per prefill chunk, decode rows batched
    "fast"       [kvH, bs, D] │ [kvH, bs, D]            the same prefill; Kev's C++ decode kernel and KV writes
    "exact"      [kvH, D, bs] │ [kvH, bs, D]            Kev's batch-invariant kernel: every row, one call
    "varlen"     [bs, kvH, D] │ [bs, kvH, D]            torch's paged varlen_attn on CUDA: every row, one call
                                                        (torch 2.10/2.11: each segment's keys gathered first)
    "triton"     [bs, kvH, D] │ [bs, kvH, D]            Kev's Triton kernel over the pool in place, every torch
    "flash-attn" [bs, kvH, D] │ [bs, kvH, D]            the flash-attn package's paged kernel, the same way
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..adapters.lora import LoraProducts, torch_delta
from ..model.kv_pool import KVPool, Shape, host_kv_cache_bytes
from ..models.ops import Ops

if TYPE_CHECKING:
    from ..model.pack import PackedBatch, Segment
    from .cuda.graphs import DecodeGraphs


class AttentionBackend:
    """One way of keeping KV and attending over it. Subclasses set `name` and the methods below."""

    name: ClassVar[str]
    default_block_size: ClassVar[int] = 32  # tokens per block: prefixes are shared in whole blocks
    block_multiple: int = 1  # block sizes the kernel accepts are multiples of this
    # False where the kernel reads only each row's own positions: stale memory in a block just handed
    # out can then reach nothing, and the engine skips clearing it
    reads_whole_blocks: ClassVar[bool] = True

    def __init__(self) -> None:
        self.pool: Any = None  # the KVPool (or a stand-in with keys, values, block_size), once bound

    def layout(self, num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> tuple[Shape, Shape]:
        """(key shape, value shape) of one layer's pool."""
        shape = (num_blocks, kv_heads, block_size, head_dim)
        return shape, shape

    def check_block_size(self, block_size: int) -> None:
        if block_size % self.block_multiple:
            raise ValueError(f"block_size={block_size} is not allowed {self.block_rule()}; "
                             f"use a multiple of {self.block_multiple}")

    def block_rule(self) -> str:
        """Who asks for the block multiple, for the error naming it."""
        return f"for the {self.name!r} attention"

    def allocate(self, model: Any, device: torch.device, dtype: torch.dtype, kv_cache_bytes: int | None,
                 block_size: int | None, useful_tokens: int | None = None,
                 default_bytes: Callable[[], int] = host_kv_cache_bytes) -> KVPool:
        """The engine's KV pool in this backend's layout, bound to it (`default_bytes()`: the budget
        when `kv_cache_bytes` is None, the platform's)."""
        size = self.default_block_size if block_size is None else block_size
        if size >= 1:
            self.check_block_size(size)
        self.bind(KVPool(model, device, dtype, kv_cache_bytes, size, self.layout, useful_tokens, default_bytes))
        return self.pool

    def bind(self, pool: Any) -> AttentionBackend:
        self.pool = pool
        return self

    def new_blocks(self, block_ids: list[int]) -> None:
        """Blocks just handed out, before the pass that writes them: cleared where the kernel reads them whole."""
        if self.reads_whole_blocks and self.pool is not None:
            self.pool.zero(block_ids)

    def plan(self, segments: Sequence[Segment], cu_seqlens: list[int], device: torch.device | str) -> Any:
        """This pass's attention metadata for the kernel (plain data; None: nothing beyond the pack)."""
        return None

    def write(self, layer: int, batch: PackedBatch, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the pass's new keys/values [kvH, T, D] at their slots (`batch.slot_blocks`, `.slot_offsets`)."""
        raise NotImplementedError

    def attend(self, layer: int, batch: PackedBatch, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Every segment over its own keys, causally: query [H, T, D] (new key/value [kvH, T, D]) → [T, H, D]."""
        raise NotImplementedError


class Platform:
    """How one engine computes on its device. Subclasses set `name` and override what differs."""

    name: str  # "cpu", "cuda", or the device type torch's ops run on
    default_pass_ms: ClassVar[float] = 300.0  # a short question's first token within about two passes

    def __init__(self, device: torch.device, attention: AttentionBackend, batch_invariant: bool) -> None:
        self.device = device
        self.attention = attention
        self.batch_invariant = batch_invariant
        self.lora_products: LoraProducts = torch_delta  # the LoRA deltas: the same products as the layers

    def install(self, model: nn.Module) -> list[str]:
        """Give a transformers model (the fallback path, already on Kev's attention) this
        platform's forwards; return the modules left on torch's own elementwise code on the
        batch-invariant path, for the engine to say. `platforms.uninstall` takes every platform's forwards off again."""
        return []

    def ops(self) -> Ops:
        """The ops Kev's own model computes with on this platform (`models.ops`: torch's here)."""
        return Ops()

    def decode_graphs(self, forward: Callable[[PackedBatch], torch.Tensor], max_rows: int,
                      max_context: int) -> DecodeGraphs | None:
        """Decode passes of Kev's model (`forward`: a pack → logits) replayed as graphs, or None
        where the platform has none."""
        return None

    def rows_alike(self, rows: int, dtype: torch.dtype) -> int:
        """The most rows a pass of `rows` rows may hold whose products keep its shape (each weight
        read as often, by the same kernel): where speculation's draft rows cost about what the cost
        model predicts for their flops (`Scheduler._drafts`). Here, none beyond its own."""
        return rows

    def use_threads(self, threads: int) -> None:
        """Compute on `threads` CPU threads (the engine's `threads`; torch's count is already set)."""

    def enter_pass_thread(self) -> None:
        """Set up the thread that runs this engine's passes, first thing on it."""

    def default_kv_cache_bytes(self) -> int:
        """The KV budget when the caller gives none."""
        return host_kv_cache_bytes()
