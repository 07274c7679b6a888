"""Llama-style decoder layers as one function over the forwards Kev installed on their parts.

Where this sits: installed on the model's decoder layers by the CPU platform where Kev's kernels
load, after `exact_linear`/`rows_linear`, `inplace` and `attention_forward` (whose forwards it
calls), and removed with them when the engine closes (`platforms.uninstall`).

Why: a decode step of one question is 30 layers of small work, and each layer reaches its parts
through `nn.Module.__call__` (the hooks machinery), transformers' keyword-argument wrappers and
the attention module's generic path, a dozen times over: several milliseconds of a step whose
products take about twenty. This forward calls the very functions the layer's own forward ends
in, on the same tensors, in the same order, so it gives bitwise what that forward gives (checked
per class on a probe), without the dispatch around them. On the batch-invariant path it also runs
q, k and v as one packed product, and the MLP's gate and up as one (`_Fused`): every output is
summed exactly as in its own product, and each call saved is a wake-up of the threads saved.
Where every part is one of Kev's kernels (the batch-invariant path, the pool Kev's exact one), the
whole layer is one call (`kernels.DecoderLayer`, csrc/layer.cpp): those kernels in that order,
without returning to Python between them.

Which layers: instances of the classes listed below (exactly those classes) whose parts all run
a forward Kev installed (the norms, the attention with its rotary kernel, the MLP, each
projection), none with hooks, and whose attention is Kev's (`KEV_ATTENTION`) without a sliding
window. A call runs the layer's own forward instead when a part, or its forward, was replaced
since (a LoRA adapter wraps its projections: `adapters.lora.wrap_targets`), a forward hook was
registered on a part or for every module (the parts then run through their own calls, which run
it: `watch.Watch`), or the model's attention is no longer Kev's, or with a transformers cache, or
cos/sin that are not one row per token in the input's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ...model.attention import KEV_ATTENTION, kev_attention
from .. import inplace
from ..inplace import modeling_class
from ..watch import Watch
from . import attention_forward, checked, exact_linear
from .exact import ExactBackend

CLASSES = ("llama.LlamaDecoderLayer", "mistral.MistralDecoderLayer", "qwen2.Qwen2DecoderLayer",
           "qwen3.Qwen3DecoderLayer")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
Forward = checked.Forward


@functools.cache
def _listed() -> frozenset[type]:
    return frozenset(found[0] for name in CLASSES if (found := modeling_class(name)) is not None)


@dataclass(frozen=True)
class _Fused:
    """Several projections of one input as one packed product: their packed weights concatenated
    along the outputs (`exact_linear`'s layout, panels whole), so each output is summed exactly as
    alone — the same bits — in one call instead of several (each call wakes the threads)."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    widths: tuple[int, ...]
    product: Callable[..., torch.Tensor]

    def __call__(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """rows [T, in] → one [T, width] view per projection (columns of one product)."""
        return self.product(rows, self.packed, sum(self.widths), self.bias).split(self.widths, dim=-1)


def _fuse(forwards: list[Any]) -> _Fused | None:
    """One product for `exact_linear` forwards of one input, or None where they do not fit whole
    panels (float32: 16 outputs, bfloat16: 32), differ in kernel or dtype, or only some have a bias
    (the kernel adds none where there is none; +0 would turn a -0 into +0). Each layer's own packed
    weight becomes a view of the fused one: no second copy. The biases are taken now, as the
    packed weights were when the engine started (`exact_linear`: a later change is not seen)."""
    if not all(isinstance(f, functools.partial) and f.func is exact_linear._forward for f in forwards):
        return None
    modules = [f.args[0] for f in forwards]
    weights: list[exact_linear.PackedWeight] = [f.args[1] for f in forwards]
    panel = 16 if weights[0].packed.dim() == 3 else 32
    if (len({f.args[2] for f in forwards}) != 1 or len({w.packed.dtype for w in weights}) != 1
            or len({w.in_features for w in weights}) != 1 or any(w.out_features % panel for w in weights)
            or len({m.bias is None for m in modules}) != 1):
        return None
    fused = torch.cat([w.packed for w in weights])
    start = 0
    for weight in weights:
        weight.packed = fused[start : start + weight.packed.shape[0]]
        start += weight.packed.shape[0]
    bias = None if modules[0].bias is None else torch.cat([m.bias.detach() for m in modules])
    return _Fused(fused, bias, tuple(w.out_features for w in weights), forwards[0].args[2])


@dataclass(frozen=True)
class _Parts:
    """A layer's parts when it was installed, and the forwards Kev gave them."""

    attention: Any  # the layer's attention module (its config, head_dim, scaling are read per call)
    norms: tuple[Forward, Forward]  # input_layernorm, post_attention_layernorm
    projections: tuple[Forward, Forward, Forward, Forward]  # q, k, v, o
    head_norms: tuple[Forward, Forward] | None  # Qwen3's q_norm and k_norm
    mlp: Forward
    rotary: attention_forward.Rotary
    watch: Watch  # each part the module it was, on its installed forward, no hooks on it or global
    qkv: _Fused | None = None  # q, k and v as one product (batch-invariant path)
    gate_up: tuple[_Fused, Any, Forward] | None = None  # gate and up as one product, silu_mul, down_proj
    native: Any = None  # the whole layer as one kernel call (`kernels.DecoderLayer`), where it can be built
    native_dtype: torch.dtype | None = None  # the dtype it computes in
    native_norms: Watch = dataclasses.field(default_factory=Watch)  # each norm's weight, the one it holds

    def in_place(self) -> bool:
        """Every part still the module it was, running the forward it ran, without hooks: nobody
        wrapped or replaced one since (a LoRA adapter, a test's control) nor hooked it."""
        return self.watch.holds()


def install(model: nn.Module, kernels: Any = None) -> None:
    """Give the listed layers whose parts all run Kev's forwards the direct forward; with Kev's
    `kernels`, a layer of exact products runs as one kernel call (`kernels.DecoderLayer`)."""
    def forward_for(layer: Any) -> Forward | None:
        parts = _parts(layer) if type(layer) in _listed() else None
        if parts is not None and kernels is not None:
            parts = _with_native(parts, kernels)
        return functools.partial(_forward, layer, parts) if parts is not None else None

    checked.install(model, forward_for, lambda out: out, "Kev's direct layer forward")


def uninstall(model: nn.Module) -> None:
    checked.uninstall(model, _forward)


def _installed(module: Any) -> Forward | None:
    """The forward Kev installed on `module` (an instance attribute), if calling it is calling the
    module: no hooks on it, none global."""
    forward = module.__dict__.get("forward") if isinstance(module, nn.Module) else None
    hooked = (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
              or module._backward_pre_hooks) if forward is not None else True
    return None if hooked else forward


def _parts(layer: Any) -> _Parts | None:
    """The layer's parts and their installed forwards, or None where one has none (or hooks)."""
    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or layer._forward_hooks or layer._forward_pre_hooks):
        return None
    attention: Any = getattr(layer, "self_attn", None)
    attention_call = _installed(attention)
    if not isinstance(attention_call, functools.partial) or attention_call.func is not attention_forward._forward:
        return None
    config = attention.config
    window = attention_call.args[2]
    if config._attn_implementation != KEV_ATTENTION or (window is not None and (
            attention.sliding_window if window == "module" else getattr(config, "sliding_window", None)) is not None):
        return None
    names = [(layer, "input_layernorm"), (layer, "post_attention_layernorm"), (layer, "mlp")]
    names += [(attention, name) for name in ATTENTION_PARTS]
    if hasattr(attention, "q_norm"):
        names += [(attention, "q_norm"), (attention, "k_norm")]
    forwards = [_installed(owner._modules.get(name)) for owner, name in names]
    if any(forward is None for forward in forwards):
        return None
    found: list[Any] = forwards
    names.append((layer, "self_attn"))
    mlp, gate_up = layer.mlp, None
    mlp_call = found[2]
    if isinstance(mlp_call, functools.partial) and mlp_call.func is inplace._mlp_forward and mlp_call.args[1]:
        mlp_parts = [_installed(mlp._modules.get(name)) for name in ("gate_proj", "up_proj", "down_proj")]
        down_proj = mlp_parts[2]
        fused = _fuse(mlp_parts[:2]) if all(f is not None for f in mlp_parts) else None
        if fused is not None and down_proj is not None:
            gate_up = (fused, mlp_call.args[1], down_proj)
            names += [(mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")]
            if "act_fn" in mlp._modules:  # the activation the kernel stands in for (`inplace` chose it by type)
                names.append((mlp, "act_fn"))
    watch = Watch().no_global_hooks()
    for owner, name in names:
        watch.part(owner, name)
    return _Parts(
        attention=attention,
        norms=(found[0], found[1]),
        mlp=mlp_call,
        projections=(found[3], found[4], found[5], found[6]),
        head_norms=(found[7], found[8]) if len(found) > 7 else None,
        rotary=attention_call.args[1],
        watch=watch,
        qkv=_fuse(found[3:6]),
        gate_up=gate_up,
    )


def _with_native(parts: _Parts, kernels: Any) -> _Parts:
    """`parts` with the layer as one kernel call where every part is one of Kev's kernels: q, k, v
    and gate, up each fused (`_Fused`), o and down exact products, every norm Kev's RMSNorm
    kernel in the products' dtype. Otherwise `parts` as they are (the calls one by one). It holds
    the norms' weights (views: a change in place is seen) and their eps as they are now, as the
    packed products hold their weights; a norm whose weight is replaced since runs the calls one
    by one (`_forward` checks)."""
    if parts.qkv is None or parts.gate_up is None:
        return parts
    norms: list[Any] = [parts.norms[0], parts.norms[1], *(parts.head_norms or ())]
    products: list[Any] = [parts.projections[3], parts.gate_up[2]]  # o_proj's and down_proj's forwards
    if (not all(isinstance(f, functools.partial) and f.func is inplace._rms_norm_kernel for f in norms)
            or not all(isinstance(f, functools.partial) and f.func is exact_linear._forward for f in products)):
        return parts
    modules = [f.args[0] for f in norms]
    dtype = parts.qkv.packed.dtype
    (o_proj, o_weight), (down_proj, down_weight) = [(f.args[0], f.args[1]) for f in products]
    if (any(m.weight.dtype != dtype or m.weight.dim() != 1 for m in modules)
            or o_weight.packed.dtype != dtype or down_weight.packed.dtype != dtype):
        return parts
    gate_up = parts.gate_up[0]
    q, k, v = parts.qkv.widths
    heads = parts.head_norms is not None
    native = kernels.DecoderLayer(
        modules[0].weight.detach(), modules[1].weight.detach(),
        modules[2].weight.detach() if heads else None, modules[3].weight.detach() if heads else None,
        [float(m.variance_epsilon) for m in modules] + ([0.0, 0.0] if not heads else []),
        parts.qkv.packed, parts.qkv.bias, o_weight.packed, _bias(o_proj), gate_up.packed, gate_up.bias,
        down_weight.packed, _bias(down_proj), [q, k, v, gate_up.widths[0]], int(parts.attention.head_dim),
        o_weight.out_features, float(parts.attention.scaling))
    held = Watch()
    for module in modules:
        held.entry(held.table(module, "_parameters"), "weight", module.weight)
    return dataclasses.replace(parts, native=native, native_dtype=dtype, native_norms=held)


def native_ready(layers: list[_Parts]) -> bool:
    """Whether every layer of `layers` runs as its one kernel call on a pass of the exact pool:
    built, every part still the one installed and unhooked, the model's attention Kev's, every
    norm's weight the one the call holds (`model_forward` calls them so directly)."""
    return attention_is_kev(layers) and all(
        parts.native is not None and parts.in_place() and _norms_held(parts) for parts in layers)


def attention_is_kev(layers: list[_Parts]) -> bool:
    """Whether the layers' attention is Kev's. Each distinct config is read once: transformers'
    config attribute lookups are slow, and every layer shares the model's."""
    configs = {id(parts.attention.config): parts.attention.config for parts in layers}
    return all(config._attn_implementation == KEV_ATTENTION for config in configs.values())


def run_native(parts: _Parts, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: ExactBackend,
               batch: Any) -> torch.Tensor:
    """The layer's one kernel call on the pass `batch` of the exact pool: hidden [T, hidden] and
    cos, sin [T, head_dim] (contiguous) → [T, hidden]."""
    pool, tables, index = backend.pool, batch.attention, int(parts.attention.layer_idx)
    return parts.native.forward(hidden, cos, sin, pool.keys[index], pool.values[index], batch.slot_blocks,
                                batch.slot_offsets, tables.block_tables, batch.cu_seqlens, tables.past_lens)


def _norms_held(parts: _Parts) -> bool:
    return parts.native_norms.holds()


def _bias(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias.detach() if bias is not None else None


def _forward(layer: Any, parts: _Parts, hidden_states: torch.Tensor,
             attention_mask: torch.Tensor | None = None,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
    """The layer's forward over Kev's installed parts: [1, T, hidden] → [1, T, hidden]."""
    dtype, shape = hidden_states.dtype, hidden_states.shape
    if (hidden_states.dim() != 3 or shape[0] != 1 or kwargs.get("cache") is not None
            or kwargs.get("past_key_values") is not None or kwargs.get("use_cache") or position_embeddings is None
            or any(t.dtype != dtype or t.shape[:-1] != shape[:-1] for t in position_embeddings)
            or not parts.in_place() or parts.attention.config._attn_implementation != KEV_ATTENTION):
        return type(layer).forward(layer, hidden_states, attention_mask=attention_mask,
                                   position_embeddings=position_embeddings, **kwargs)
    attention, (q_proj, k_proj, v_proj, o_proj) = parts.attention, parts.projections
    tokens, dim = shape[1], int(attention.head_dim)
    batch, backend = kwargs.get("kev_pack"), kwargs.get("kev_backend")
    if (parts.native is not None and dtype == parts.native_dtype and type(backend) is ExactBackend
            and batch is not None and batch.slot_blocks is not None and attention_mask is None
            and _norms_held(parts)):
        cos, sin = (t.reshape(-1, t.shape[-1]).contiguous() for t in position_embeddings)
        return run_native(parts, hidden_states.reshape(tokens, -1), cos, sin, backend, batch).view(shape)
    residual = hidden_states
    normed = parts.norms[0](hidden_states)
    if parts.qkv is not None:
        query, key, value = parts.qkv(normed.view(tokens, -1))
    else:
        query, key, value = q_proj(normed), k_proj(normed), v_proj(normed)
    query, key = query.view(1, tokens, -1, dim), key.view(1, tokens, -1, dim)
    if parts.head_norms is not None:  # Qwen3: per-head norms before the rotary
        query, key = parts.head_norms[0](query), parts.head_norms[1](key)
    value = value.view(1, tokens, -1, dim).transpose(1, 2)
    cos, sin = (t.reshape(-1, t.shape[-1]) for t in position_embeddings)
    query = attention_forward._rotate(parts.rotary, query, cos, sin).transpose(1, 2)
    key = attention_forward._rotate(parts.rotary, key, cos, sin).transpose(1, 2)
    out, _ = kev_attention(attention, query, key, value, attention_mask, scaling=attention.scaling, **kwargs)
    hidden_states = residual + o_proj(out.reshape(1, tokens, -1).contiguous())
    residual = hidden_states
    normed = parts.norms[1](hidden_states)
    if parts.gate_up is None:
        return residual + parts.mlp(normed)
    fused, silu_mul, down_proj = parts.gate_up  # the MLP's kernel path: silu(gate) * up, then down
    gate, up = fused(normed.view(tokens, -1))
    product = gate.new_empty(gate.shape)
    silu_mul(gate, up, product)
    return residual + down_proj(product.view(1, tokens, -1))
