"""The decoder layers' direct forward (kev_engine.platforms.cpu.layer_forward): bitwise the layer's
own forward over Kev's installed parts, installed only on the listed classes whose forward it
still matches (checked on a probe) and whose parts all run Kev's forwards without hooks, on both
CPU paths, removed with the engine; a layer whose projection an adapter wrapped since, or a call
with a transformers cache, runs the layer's own forward. On the batch-invariant path a layer runs
as one kernel call (`kernels.DecoderLayer`): bitwise its kernels called one by one.

End to end, every isolation and invariance test runs engines that use it against plain
transformers models and against themselves alone.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from conftest import FAMILIES, tiny_model
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from kev_engine import Engine, SamplingParams
from kev_engine.adapters.lora import LoraRouter, wrap_targets
from kev_engine.model.pack import Segment, pack
from kev_engine.model.setup import prepare_model
from kev_engine.platforms import uninstall
from kev_engine.platforms.cpu import exact_linear, layer_forward
from kev_engine.platforms.cpu.kernels import load_kernels
from kev_engine.platforms.cpu.platform import CpuPlatform


def ours(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is layer_forward._forward


def parts(layer: torch.nn.Module) -> layer_forward._Parts:
    return layer.__dict__["forward"].args[1]


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.model.layers)


def probe(model: torch.nn.Module, layer: torch.nn.Module, seed: int = 1) -> tuple[torch.Tensor, dict]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 5, model.config.hidden_size, generator=generator)
    dim = layer.self_attn.head_dim
    cos, sin = (torch.randn(1, 5, dim, generator=generator) for _ in range(2))
    segment = Segment(request_id=0, token_ids=[1, 2, 3, 4, 5], past_len=0, needs_logits=False)
    return hidden, {"position_embeddings": (cos, sin), "attention_mask": None, "kev_pack": pack([segment])}


def kev_model(tokenizer) -> torch.nn.Module:
    """A tiny Llama on Kev's packed attention, as an engine prepares it (the platform not installed)."""
    model = tiny_model("llama", tokenizer)
    prepare_model(model)
    return model


def install(model: torch.nn.Module) -> torch.nn.Module:
    """The batch-invariant CPU path's forwards on `model`, as an engine installs them."""
    CpuPlatform(torch.device("cpu"), load_kernels(), batch_invariant=True).install(model)
    return model


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_installs_on_the_listed_classes_and_close_removes(family: str, invariant: bool, tokenizer) -> None:
    model = tiny_model(family, tokenizer)
    engine = Engine(model, tokenizer, batch_invariant=invariant)
    try:
        found = layers(model)
        assert found and all(ours(m) for m in found) == (family != "glm")  # GLM's layers are not listed
        if family != "glm":  # the batch-invariant path fuses q/k/v and gate/up into one product each
            assert {(p.qkv is not None, p.gate_up is not None) for p in map(parts, found)} == {(invariant, invariant)}
        for layer in found:
            hidden, kwargs = probe(model, layer)
            with torch.inference_mode():
                direct = layer(hidden, **kwargs)
                own = type(layer).forward(layer, hidden, **kwargs)
            assert torch.equal(direct, own)
    finally:
        engine.close()
    assert not any(ours(m) for m in model.modules())


def test_a_listed_class_whose_forward_changed_keeps_its_own(monkeypatch: pytest.MonkeyPatch, tokenizer,
                                                           caplog) -> None:
    """What a transformers release rewriting LlamaDecoderLayer would look like: Kev leaves it alone."""
    shipped = LlamaDecoderLayer.forward

    def scaled(self, hidden_states, *args, **kwargs):
        return shipped(self, hidden_states, *args, **kwargs) * 0.5

    model = kev_model(tokenizer)
    monkeypatch.setattr(LlamaDecoderLayer, "forward", scaled)
    with caplog.at_level("WARNING", logger="kev"):
        install(model)
    assert not any(ours(m) for m in layers(model))
    said = "LlamaDecoderLayer keeps its own forward, not Kev's direct layer forward"
    assert caplog.text.count(said) == 1  # checked once per class
    monkeypatch.undo()
    layer_forward.install(model)
    assert all(ours(m) for m in layers(model))
    uninstall(model)
    assert not any(ours(m) for m in model.modules())


def test_a_layer_whose_parts_are_not_all_kevs_keeps_its_own(tokenizer) -> None:
    """A part without Kev's forward (the model as it came), or with a hook: the layer is not installed."""
    model = kev_model(tokenizer)
    layer_forward.install(model)  # nothing of Kev's on the parts
    assert not any(ours(m) for m in layers(model))
    hooked = kev_model(tokenizer)
    layers(hooked)[1].mlp.register_forward_hook(lambda module, args, out: out)
    install(hooked)
    assert [ours(m) for m in layers(hooked)] == [True, False] + [True] * (len(layers(hooked)) - 2)


def test_calls_it_cannot_take_go_to_the_layer_forward(monkeypatch: pytest.MonkeyPatch, tokenizer) -> None:
    """A call asking for a transformers cache, a projection wrapped for LoRA after install, a part
    whose forward someone replaced, or a model whose attention is no longer Kev's: the class's
    forward runs."""
    model = install(kev_model(tokenizer))
    layer = layers(model)[0]
    assert ours(layer)
    calls = []
    shipped = LlamaDecoderLayer.forward
    monkeypatch.setattr(LlamaDecoderLayer, "forward",
                        lambda self, *args, **kwargs: calls.append(1) or shipped(self, *args, **kwargs))
    hidden, kwargs = probe(model, layer)
    with torch.inference_mode():
        before = layer(hidden, **kwargs)
        assert calls == []  # the direct forward
        assert torch.equal(layer(hidden, use_cache=True, **kwargs), before) and calls == [1]
        wrap_targets(model, ["model.layers.0.self_attn.q_proj"], LoraRouter())
        after = layer(hidden, **kwargs)
    assert calls == [1, 1] and ours(layer)
    assert torch.equal(before, after)  # no adapter routed: the wrapped projection is the same product
    down, layer = layers(model)[1].mlp.down_proj, layers(model)[1]
    kevs = down.forward
    down.forward = functools.partial(torch.nn.Linear.forward, down)  # a part's forward replaced later
    with torch.inference_mode():
        layer(hidden, **kwargs)
    assert calls == [1, 1, 1]
    down.forward = kevs
    with torch.inference_mode():
        layer(hidden, **kwargs)
    assert calls == [1, 1, 1]  # its own part back: the direct forward again
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        layer(hidden, **kwargs)
    assert calls == [1, 1, 1, 1]  # the model's attention is no longer Kev's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_products_are_each_projection_alone_bitwise(dtype: torch.dtype) -> None:
    """Three projections as one product: each one's columns equal its own product, bitwise; what
    does not fill whole panels, or mixes biased and unbiased layers, is not fused."""
    kernels = load_kernels()
    generator = torch.Generator().manual_seed(3)
    projections = [torch.nn.Linear(48, width, bias=True).to(dtype) for width in (64, 32, 96)]
    exact_linear.install(torch.nn.Sequential(*projections), kernels)
    rows = torch.randn(7, 48, generator=generator).to(dtype)
    alone = [layer(rows) for layer in projections]
    fused = layer_forward._fuse([layer.__dict__["forward"] for layer in projections])
    assert fused is not None
    assert all(torch.equal(got, want) for got, want in zip(fused(rows), alone, strict=True))
    assert all(torch.equal(layer(rows), want) for layer, want in zip(projections, alone, strict=True))  # views now
    odd = torch.nn.Linear(48, 40 if dtype == torch.float32 else 48).to(dtype)  # not whole panels
    plain = torch.nn.Linear(48, 64, bias=False).to(dtype)
    exact_linear.install(torch.nn.Sequential(odd, plain), kernels)
    assert layer_forward._fuse([odd.__dict__["forward"], projections[0].__dict__["forward"]]) is None
    assert layer_forward._fuse([plain.__dict__["forward"], projections[0].__dict__["forward"]]) is None


def _per_call(model: torch.nn.Module) -> None:
    """Every installed layer back to its kernels one call at a time (its parts without `native`)."""
    for layer in layers(model):
        forward = layer.__dict__["forward"]
        layer.forward = functools.partial(layer_forward._forward, layer,
                                          dataclasses.replace(forward.args[1], native=None))


def _logits(engine: Engine, salt: str) -> list[torch.Tensor]:
    prompts = [[{"role": "user", "content": f"Question {i}: " + "where does the river go " * (3 + 5 * i)}]
               for i in range(4)]
    sampling = SamplingParams(temperature=0, max_tokens=6, cache_salt=salt)
    return [logits for _, logits in engine.generate_with_logits(prompts, [sampling] * 4, [None] * 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "glm"])
def test_the_layer_as_one_kernel_call_is_its_kernels_one_by_one_bitwise(family: str, dtype: torch.dtype,
                                                                       tokenizer) -> None:
    """`kernels.DecoderLayer` (the batch-invariant path's layer in one call, pool and all) against
    the same kernels called one by one from Python: prefill and decode steps of a pack, torch.equal
    on every logit. The control, a native layer built with its norms' eps doubled, differs: the
    comparison sees one layer's constant."""
    engine = Engine(tiny_model(family, tokenizer).to(dtype), tokenizer)
    try:
        found = layers(engine.model)
        assert all(parts(layer).native is not None for layer in found)
        native = _logits(engine, "native")
        _per_call(engine.model)
        assert all(parts(layer).native is None for layer in found)
        assert all(torch.equal(a, b) for a, b in zip(native, _logits(engine, "per-call"), strict=True))
        first = found[0]
        norm = first.input_layernorm
        norm.variance_epsilon *= 2
        layer_forward.uninstall(engine.model)
        layer_forward.install(engine.model, load_kernels())
        norm.variance_epsilon /= 2  # the control's layer holds the doubled eps; the Python path reads it live
        assert parts(first).native is not None
        assert not all(torch.equal(a, b) for a, b in zip(native, _logits(engine, "control"), strict=True))
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_layers_residual_kernel_is_torchs_add_bitwise(dtype: torch.dtype) -> None:
    """`add_into` (the one-call layer's residual additions) against torch's `residual + out`, in
    place, over widths with and without a partial last vector and a residual read with a row
    stride, bitwise. The control rounds the same fp32 sums toward zero: the data holds sums that
    rounding decides, so a kernel that rounded otherwise would fail."""
    kernels = load_kernels()
    generator = torch.Generator().manual_seed(5)
    for rows, width in ((1, 7), (3, 16), (16, 576), (5, 1000)):
        wide = torch.randn(rows, width + 9, generator=generator).to(dtype)
        residual = wide[:, 3:3 + width]  # rows `width + 9` apart
        out = torch.randn(rows, width, generator=generator).to(dtype)
        before, expected = out.clone(), residual + out
        kernels.add_into(out, residual)
        assert torch.equal(out, expected), (rows, width)
    if dtype == torch.bfloat16:
        sums = residual.float() + before.float()
        truncated = (sums.view(torch.int32) & -65536).view(torch.float32).to(dtype)
        assert not torch.equal(truncated, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rotary_kernel_reads_strided_rows_as_their_contiguous_copy(dtype: torch.dtype) -> None:
    """The one-call layer rotates queries and keys in place in the packed q/k/v product: the rotary
    kernel over such a strided view gives bitwise what it gives over a contiguous copy. The control
    reads the neighbouring heads of the same product and differs."""
    kernels = load_kernels()
    generator = torch.Generator().manual_seed(6)
    tokens, dim = 5, 16
    qkv = torch.randn(tokens, (4 + 2 + 2) * dim, generator=generator).to(dtype)
    angles = torch.randn(tokens, dim, generator=generator)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    query = qkv.narrow(1, 0, 4 * dim).view(tokens, -1, dim)
    key = qkv.narrow(1, 4 * dim, 2 * dim).view(tokens, -1, dim)
    assert not query.is_contiguous() and not key.is_contiguous()
    for view in (query, key):
        assert torch.equal(kernels.rotary(view, cos, sin), kernels.rotary(view.contiguous(), cos, sin))
    shifted = qkv.narrow(1, dim, 4 * dim).view(tokens, -1, dim)
    assert not torch.equal(kernels.rotary(shifted, cos, sin), kernels.rotary(query.contiguous(), cos, sin))
