"""In-place MLP and RMSNorm forwards (kev_engine.platforms.inplace): bitwise what the module's own forward
gives (with torch's activation; with Kev's silu_mul kernel, equal to rounding), the input left
untouched, installed only on the classes listed in `inplace` whose forward still computes Kev's
formula (checked on a probe input, so a rewritten class keeps its own), removed with the engine.

End to end, every isolation test compares an engine using them against an independent plain
transformers model that does not (reference_copy), on every family.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import FAMILIES, tiny_model
from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP, LlamaRMSNorm

from kev_engine import Engine
from kev_engine.platforms import inplace


def ours(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func in (
        inplace._mlp_forward, inplace._glm_mlp_forward, inplace._rms_norm_forward, inplace._rms_norm_kernel)


def is_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def is_mlp(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("MLP")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_installs_on_the_listed_classes_and_close_removes(family: str, tokenizer) -> None:
    model = tiny_model(family, tokenizer)
    engine = Engine(model, tokenizer, batch_invariant=False, model_impl="transformers")
    try:
        norms = [m for m in model.modules() if is_norm(m)]
        mlps = [m for m in model.modules() if is_mlp(m)]
        assert norms and mlps
        assert all(ours(m) for m in norms)
        # GLM's MLP is a fused gate_up projection written differently: it keeps its own forward
        assert all(ours(m) for m in mlps) == (family != "glm") and any(ours(m) for m in mlps) == (family != "glm")
        torch.manual_seed(0)
        with torch.inference_mode():
            for module in norms + mlps:
                # Qwen3's q/k norms are head-sized
                width = module.weight.shape[0] if is_norm(module) else model.config.hidden_size
                x = torch.randn(1, 7, width)
                kept = x.clone()
                got = module(x)
                assert torch.equal(x, kept)  # the residual stream is never written over
                assert torch.equal(got, type(module).forward(module, x)), type(module).__name__
    finally:
        engine.close()
    assert not any(ours(m) for m in model.modules())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_invariant_engine_computes_every_mlp_activation_by_the_kernel(family: str, tokenizer) -> None:
    """GLM's fused gate_up MLP included; equal to the module's own forward up to silu's rounding."""
    model = tiny_model(family, tokenizer)
    engine = Engine(model, tokenizer, batch_invariant=True, model_impl="transformers")
    try:
        mlps = [m for m in model.modules() if is_mlp(m)]
        assert mlps and all(ours(m) for m in mlps)
        x = torch.randn(1, 7, model.config.hidden_size)
        with torch.inference_mode():
            for mlp in mlps:
                expected = type(mlp).forward(mlp, x)  # its Linear layers are the engine's exact ones
                torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)
    finally:
        engine.close()
    assert not any(ours(m) for m in model.modules())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_invariant_engine_computes_every_norm_by_the_kernel(family: str, tokenizer) -> None:
    """Qwen3's head-sized q/k norms included; equal to the module's own forward up to the order of
    the squares' sum, and a row's result the same alone as among others."""
    model = tiny_model(family, tokenizer)
    engine = Engine(model, tokenizer, batch_invariant=True, model_impl="transformers")
    try:
        norms = [m for m in model.modules() if is_norm(m)]
        assert norms and all(m.__dict__["forward"].func is inplace._rms_norm_kernel for m in norms)
        torch.manual_seed(0)
        with torch.inference_mode():
            for norm in norms:
                norm.weight.normal_(1.0, 0.5)
                x = torch.randn(1, 7, norm.weight.shape[0]) * 4
                got = norm(x)
                torch.testing.assert_close(got, type(norm).forward(norm, x), atol=1e-5, rtol=1e-5)
                assert torch.equal(got[:, 3:4], norm(x[:, 3:4]))
    finally:
        engine.close()
    assert not any(ours(m) for m in model.modules())


def test_kernel_norm_falls_back_where_the_kernel_does_not_apply(tokenizer) -> None:
    """An input of another dtype than the weight goes through the in-place torch form, bitwise."""
    from kev_engine.platforms.cpu.kernels import load_kernels

    norm = LlamaRMSNorm(40, eps=1e-5).to(torch.bfloat16)
    x = torch.randn(3, 40)  # float32 into a bfloat16 norm
    with torch.inference_mode():
        got = inplace._rms_norm_kernel(norm, load_kernels().rms_norm, x)
        assert torch.equal(got, norm(x))


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_mlp_equals_its_own_forward(act: str) -> None:
    torch.manual_seed(1)
    mlp = LlamaMLP(LlamaConfig(hidden_size=48, intermediate_size=112, num_attention_heads=4, hidden_act=act)).eval()
    x = torch.randn(2, 33, 48)
    with torch.inference_mode():
        assert torch.equal(inplace._mlp_forward(mlp, None, x), mlp(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_its_own_forward(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    norm = LlamaRMSNorm(40, eps=1e-5)
    norm.weight.data = torch.randn(40)
    norm = norm.to(dtype)
    x = (torch.randn(3, 9, 40) * 5).to(dtype)
    with torch.inference_mode():
        assert torch.equal(inplace._rms_norm_forward(norm, x), norm(x))


def test_other_forwards_are_left_alone() -> None:
    class GemmaStyleNorm(LlamaRMSNorm):  # a forward written differently: not Llama's
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states) * (1.0 + self.weight)

    model = torch.nn.Sequential(GemmaStyleNorm(8), LlamaRMSNorm(8), LlamaRMSNorm(8))
    hooked = model[2]
    hook = hooked.forward = functools.partial(LlamaRMSNorm.forward, hooked)  # as accelerate's hooks do
    inplace.install(model)
    assert not ours(model[0]) and ours(model[1]) and hooked.__dict__["forward"] is hook
    inplace.uninstall(model)
    assert "forward" not in model[1].__dict__ and hooked.__dict__["forward"] is hook


def test_a_listed_class_whose_forward_changed_keeps_its_own(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """What a transformers release rewriting LlamaMLP or LlamaRMSNorm would look like: the class is
    still listed, but its forward no longer computes Kev's formula, so Kev leaves it alone."""
    def other_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)

    def other_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)

    config = LlamaConfig(hidden_size=48, intermediate_size=112, num_attention_heads=4)
    model = torch.nn.Sequential(LlamaMLP(config), LlamaRMSNorm(48), LlamaMLP(config))
    monkeypatch.setattr(LlamaMLP, "forward", other_mlp)
    inplace.install(model)
    assert not ours(model[0]) and not ours(model[2]) and ours(model[1])
    assert caplog.text.count("LlamaMLP.forward no longer computes") == 1  # checked once per class
    inplace.uninstall(model)
    monkeypatch.undo()  # LlamaMLP as shipped; now LlamaRMSNorm rewritten
    monkeypatch.setattr(LlamaRMSNorm, "forward", other_norm)
    inplace.install(model)
    assert ours(model[0]) and not ours(model[1])
