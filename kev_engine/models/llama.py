"""Kev's forward for the Llama-shaped families: Llama (SmolLM2, Llama 2/3), Mistral, Qwen2/2.5, Qwen3.

Where this sits: `ModelRunner` runs every pass's `PackedBatch` through it, whole (`forward`) or
in slices other passes may run between (`begin`, `advance`, `end`: `stepper`); `models.load`
builds it from a checkpoint. It is plain code over Kev's weight layout (`layout`)
and the platform's ops (`ops.Ops`): the same forward on every platform, nothing of transformers'
modules on the way (their tokenizer and chat template are still Kev's, in `inputs`).

What differs between the families is read from the config and the checkpoint, never guessed:
q/k/v biases (Qwen2; Llama's `attention_bias`) are there when the checkpoint has them, Qwen3's
per-head q/k norms likewise, `head_dim` where the config sets it, the rope block (`rope`), a tied
output head (`tie_word_embeddings`: the head reads the embedding table). Weights a GGUF stores
quantized stay so where the checkpoint hands them over that way (`quant`): the products and the
embedding lookup then decode them (the platform's ops). A sliding window narrower
than the engine's context is refused at load (`setup.check_packable`): Kev's attention has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..adapters.lora import LoraRoutes
from .layout import Layer, Linear, Tensors, read_tensor
from .ops import Ops
from .quant import QuantTensor, QuantWeight
from .rope import Rope

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj")
MLP_PARTS = ("gate_proj", "up_proj")


@dataclass
class PassState:
    """A pass between two layers: what it needs to resume (`DecoderModel.advance`)."""

    batch: Any  # the PackedBatch
    backend: Any  # its attention backend, bound to the KV pool
    routes: list[Any]  # each adapter's rows of this pass
    hidden: torch.Tensor  # [T, hidden] after `next_layer` layers
    cos: torch.Tensor  # [T, head_dim]
    sin: torch.Tensor
    next_layer: int = 0
    next_row: int = 0  # rows of `next_layer` already computed, while it runs in row slices
    out: torch.Tensor | None = None  # [T, hidden]: `next_layer`'s output so far, those rows

    @property
    def num_rows(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def rows_done(self) -> int:
        """Rows of layers computed so far (a whole layer is `num_rows` of them)."""
        return self.next_layer * self.num_rows + self.next_row


class DecoderModel:
    """One Llama-shaped causal LM in Kev's layout. Not an `nn.Module`: nothing hooks into it, and
    `forward` is the whole computation."""

    impl = "kev"

    def __init__(self, family: str, config: Any, tensors: Tensors, dtype: torch.dtype, device: torch.device,
                 generation_config: Any = None) -> None:
        text = config.get_text_config()
        self.family, self.config, self.generation_config = family, config, generation_config
        self.dtype, self.device = dtype, device
        self.num_heads = int(text.num_attention_heads)
        self.num_kv_heads = int(getattr(text, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.num_heads)
        self.hidden = int(text.hidden_size)
        self.intermediate = int(text.intermediate_size)
        self.eps = float(text.rms_norm_eps)
        self.scaling = self.head_dim**-0.5
        table = tensors("model.embed_tokens.weight")
        self.embed: torch.Tensor | QuantWeight  # [vocab, hidden]
        if isinstance(table, QuantTensor):
            self.embed = QuantWeight.of([table])
        else:
            self.embed = read_tensor(tensors, "model.embed_tokens.weight", dtype, device)
        self.layers = [self._read_layer(tensors, i) for i in range(int(text.num_hidden_layers))]
        self.norm = read_tensor(tensors, "model.norm.weight", dtype, device)
        if getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False):
            if isinstance(self.embed, QuantWeight):
                self.head = Linear(None, None, (self.embed.out_features,), ("lm_head",), self.hidden, quant=self.embed)
            else:
                self.head = Linear(self.embed, None, (int(self.embed.shape[0]),), ("lm_head",), self.hidden)
        else:
            self.head = Linear.read(tensors, ["lm_head"], dtype, device)
        self.rope = Rope(text, self.head_dim, dtype, device)
        self.ops = Ops()
        self.weights = "dense"  # or how a GGUF's weights are kept (`load.from_gguf`)
        self.weights_choice: str | None = None  # why, for a GGUF (the loader's `weights`)

    def _read_layer(self, tensors: Tensors, index: int) -> Layer:
        prefix = f"model.layers.{index}."

        def linear(names: list[str]) -> Linear:
            return Linear.read(tensors, [prefix + name for name in names], self.dtype, self.device)

        def norm(name: str) -> torch.Tensor:
            return read_tensor(tensors, prefix + name, self.dtype, self.device)

        heads = tensors(prefix + "self_attn.q_norm.weight") is not None
        return Layer(
            index=index,
            input_norm=norm("input_layernorm.weight"),
            post_norm=norm("post_attention_layernorm.weight"),
            qkv=linear([f"self_attn.{p}" for p in ATTENTION_PARTS]),
            o=linear(["self_attn.o_proj"]),
            gate_up=linear([f"mlp.{p}" for p in MLP_PARTS]),
            down=linear(["mlp.down_proj"]),
            q_norm=norm("self_attn.q_norm.weight") if heads else None,
            k_norm=norm("self_attn.k_norm.weight") if heads else None,
        )

    def use(self, ops: Ops) -> DecoderModel:
        """Compute with `ops` from now on (a platform's; each weight put in its layout once)."""
        self.ops = ops
        ops.prepare(self)
        return self

    def parameters(self) -> Any:
        """The dense tensors Kev computes with (the final norm first: its dtype and device are the
        model's); quantized weights are in `quantized()`."""
        yield self.norm
        if isinstance(self.embed, torch.Tensor):
            yield self.embed
        for layer in self.layers:
            yield from (t for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm) if t is not None)
            yield from (t for linear in layer.linears for t in (linear.weight, linear.bias) if t is not None)

    def quantized(self) -> list[QuantWeight]:
        """The weights kept as a GGUF stores them (the embedding table once, though a tied head reads it)."""
        found = [self.embed] if isinstance(self.embed, QuantWeight) else []
        return found + [linear.quant for linear in self.linears() if linear.quant is not None
                        and linear.quant is not self.embed]

    def weight_bytes(self) -> int:
        """Memory the weights take: dense tensors, quantized ones and the platform's packed copies."""
        dense = {id(t): t.nbytes for t in self.parameters()}
        dense.update({id(linear.packed): linear.packed.nbytes for linear in self.linears()
                      if isinstance(linear.packed, torch.Tensor)})
        return sum(dense.values()) + sum(q.nbytes for q in self.quantized())

    def linears(self) -> list[Linear]:
        """Every product of a token's pass, the output head last."""
        return [linear for layer in self.layers for linear in layer.linears] + [self.head]

    def lora_target(self, name: str) -> tuple[int, int] | None:
        """(in_features, out_features) of the projection a LoRA adapter names (PEFT's module
        name, e.g. `model.layers.0.self_attn.q_proj`), or None where Kev has no such part."""
        for linear in self.linears()[:-1]:
            if name in linear.names:
                return linear.in_features, linear.widths[linear.names.index(name)]
        return None

    def forward(self, batch: Any, backend: Any, routes: LoraRoutes = (),
                all_logits: bool = False) -> torch.Tensor:
        """fp32 logits [K, vocab] at `batch.logits_indices` (or [T, vocab] with `all_logits`).

        `backend`: the attention backend `batch` was packed for, bound to the KV pool (for a pack
        without KV memory, `platforms.torch_ops.TorchBackend()`); `routes`: each adapter's rows of
        this pass."""
        state = self.begin(batch, backend, routes)
        self.advance(state, len(self.layers) * state.num_rows)
        return self.end(state, all_logits)

    @torch.inference_mode()
    def begin(self, batch: Any, backend: Any, routes: LoraRoutes = ()) -> PassState:
        """A pass before its first layer: the embedding and the pass's rotary rows."""
        cos, sin = self.rope.lookup(batch.position_ids)  # [T, head_dim] each
        return PassState(batch, backend, list(routes), self.ops.embedding(batch.input_ids, self.embed), cos, sin)

    @torch.inference_mode()
    def advance(self, state: PassState, rows: int) -> None:
        """Run the pass's next `rows` rows of layers (a whole layer is `state.num_rows` rows; fewer
        where fewer are left): whole layers where it can, else the next rows of one layer. Between
        two calls the pass holds its hidden states and nothing else: other passes may run
        meanwhile, each over its own rows and KV blocks, and the pass resumes with the same bits
        (every row of a layer is computed by itself, and attention reads the keys and values the
        earlier rows of this layer wrote to the pool). A pass with LoRA rows moves by whole layers."""
        total = state.num_rows
        while rows > 0 and state.next_layer < len(self.layers):
            layer = self.layers[state.next_layer]
            if state.next_row == 0 and (rows >= total or state.routes):
                whole = self.layers[state.next_layer : state.next_layer + max(1, rows // total)]
                state.hidden = self._run(whole, state.hidden, state.cos, state.sin, state.backend, state.batch,
                                         state.routes)
                state.next_layer += len(whole)
                rows -= len(whole) * total
                continue
            start, stop = state.next_row, min(total, state.next_row + rows)
            if state.out is None:
                state.out = torch.empty_like(state.hidden)
            state.out[start:stop] = self._rows(layer, state, start, stop)
            rows -= stop - start
            state.next_row = stop
            if stop == total:
                state.hidden, state.out = state.out, None
                state.next_layer, state.next_row = state.next_layer + 1, 0

    def _run(self, layers: list[Layer], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Any,
             batch: Any, routes: LoraRoutes) -> torch.Tensor:
        """Consecutive layers over `batch`'s rows: the platform's one call where it has one (never
        with LoRA rows), else op by op, a layer at a time, each layer's last residual add made
        with the next layer's first norm (`Ops.add_rms_norm`)."""
        out = None if routes else self.ops.layers(layers, hidden, cos, sin, backend, batch)
        if out is not None:
            return out
        delta = None
        for layer in layers:
            hidden, delta = self._layer(layer, hidden, delta, cos, sin, backend, batch, routes)
        return hidden + delta

    def _rows(self, layer: Layer, state: PassState, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of one layer, as a pack of their own: each segment's rows there,
        after what it has in the pool (its earlier rows of this layer included)."""
        rows = _rows_batch(state.batch, state.backend, start, stop)
        return self._run([layer], state.hidden[start:stop], state.cos[start:stop], state.sin[start:stop],
                         state.backend, rows, ())

    @torch.inference_mode()
    def end(self, state: PassState, all_logits: bool = False) -> torch.Tensor:
        """The final norm and the output head of a pass whose layers have all run: fp32 logits."""
        assert state.next_layer == len(self.layers), "a pass ends after its last layer"
        hidden, prompt = state.hidden, state.batch.prompt
        rows = hidden if all_logits else hidden.index_select(0, state.batch.logits_indices)  # [K, hidden]
        if prompt is not None and not all_logits:
            prompt = prompt.index_select(0, state.batch.logits_indices)
        rows = self.ops.rms_norm(rows, self.norm, self.eps)
        return self.ops.linear(rows, self.head, prompt).float()  # [K, vocab]

    def _layer(self, layer: Layer, hidden: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor, backend: Any, batch: Any, routes: LoraRoutes) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer, op by op: hidden [T, hidden] plus the layer before's MLP output `delta`
        (None for a pass's first layer here) → this layer's hidden after attention and its MLP
        output, whose sum is the layer's output."""
        ops, tokens = self.ops, hidden.shape[0]

        def linear(x: torch.Tensor, part: Linear) -> torch.Tensor:
            out = ops.linear(x, part, batch.prompt)
            return ops.with_lora(out, x, part, routes) if routes else out

        if delta is None:
            normed = ops.rms_norm(hidden, layer.input_norm, self.eps)
        else:
            hidden, normed = ops.add_rms_norm(hidden, delta, layer.input_norm, self.eps)
        q_width, k_width, _ = layer.qkv.widths
        qkv = linear(normed, layer.qkv)  # [T, q + k + v]
        query = qkv[:, :q_width].view(tokens, self.num_heads, self.head_dim)
        key = qkv[:, q_width : q_width + k_width].view(tokens, self.num_kv_heads, self.head_dim)
        value = qkv[:, q_width + k_width :].view(tokens, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3: per-head norms before the rotary
            query, key = ops.rms_norm(query, layer.q_norm, self.eps), ops.rms_norm(key, layer.k_norm, self.eps)
        query, key = ops.rotary_qk(query, key, cos, sin)  # [T, heads, D], [T, kv_heads, D]
        attended = attend(backend, layer.index, batch, query, key, value, self.scaling)  # [T, heads, D]
        hidden, normed = ops.add_rms_norm(hidden, linear(attended.reshape(tokens, -1), layer.o), layer.post_norm,
                                          self.eps)
        gate_up = linear(normed, layer.gate_up)  # [T, 2 * inter]
        return hidden, linear(ops.silu_mul(gate_up, self.intermediate), layer.down)


def _rows_batch(batch: Any, backend: Any, start: int, stop: int) -> Any:
    """The pack of rows [start, stop) of `batch`: each segment's rows in that range, continuing
    after its rows before it."""
    from ..model.pack import Segment, pack

    ids = batch.input_ids[start:stop].tolist()
    bounds = batch.cu_seqlens_list
    segments = []
    for i in range(len(bounds) - 1):
        low, high = max(bounds[i], start), min(bounds[i + 1], stop)
        if low < high:
            prompt_end = bounds[i] + batch.prompt_rows[i]  # the segment's prompt rows end here
            segments.append(Segment(request_id=batch.request_ids[i], token_ids=ids[low - start : high - start],
                                    past_len=batch.past_lens[i] + low - bounds[i], needs_logits=False,
                                    block_ids=batch.block_tables[i],
                                    prompt_rows=max(0, min(high, prompt_end) - low)))
    return pack(segments, batch.input_ids.device, backend if batch.slot_blocks is not None else None)


def attend(backend: Any, layer: int, batch: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float) -> torch.Tensor:
    """Every segment over its own keys: query [T, H, D], key/value [T, kvH, D] → [T, H, D]. The
    new keys/values go into the pool first: a later segment of the same pass may read them."""
    if backend is None:
        from ..model.attention import NO_BACKEND

        raise ValueError(NO_BACKEND)
    key, value = key.transpose(0, 1), value.transpose(0, 1)  # [kvH, T, D]
    if batch.slot_blocks is not None:
        backend.write(layer, batch, key, value)
    return backend.attend(layer, batch, query.transpose(0, 1), key, value, scaling)
