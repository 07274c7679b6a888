"""The attention modules' forward with the rotary by Kev's kernel (kev_engine.platforms.cpu.attention_forward):
bitwise transformers' rotary formula, installed only on the listed classes whose forward it still
matches (checked on a probe, so a rewritten class keeps its own), on both CPU paths, removed with
the engine.

End to end, every isolation test compares an engine using it against an independent plain
transformers model that does not (reference_copy), on every family.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import FAMILIES, tiny_model
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from kev_engine import Engine
from kev_engine.model.pack import Segment, pack
from kev_engine.platforms.cpu import attention_forward
from kev_engine.platforms.cpu.kernels import load_kernels


def ours(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is attention_forward._forward


def attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [64, 16, 6])
def test_kernel_is_transformers_formula_bitwise(dtype: torch.dtype, dim: int) -> None:
    """Whole vectors, a half of one vector, and a half shorter than a vector, rows past the kernel's grain."""
    generator = torch.Generator().manual_seed(dim)
    rows, heads = 700, 3
    x = (torch.randn(rows, heads, dim, generator=generator) * 4).to(dtype)
    cos, sin = (torch.randn(rows, dim, generator=generator).to(dtype) for _ in range(2))
    got = load_kernels().rotary(x, cos, sin)
    as_transformers = x.transpose(0, 1)[None]  # [1, H, T, D]
    expected, _ = apply_rotary_pos_emb(as_transformers, as_transformers, cos[None], sin[None])
    assert got.dtype == dtype and torch.equal(got, expected[0].transpose(0, 1))
    wrong, _ = apply_rotary_pos_emb(as_transformers, as_transformers, sin[None], cos[None])  # control: it can fail
    assert not torch.equal(got, wrong[0].transpose(0, 1))


def test_kernel_refuses_what_it_cannot_rotate() -> None:
    rotary = load_kernels().rotary
    with pytest.raises(RuntimeError, match="dim even"):
        rotary(torch.randn(2, 1, 5), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="one dtype"):
        rotary(torch.randn(2, 1, 4), torch.randn(2, 4).bfloat16(), torch.randn(2, 4).bfloat16())


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_installs_on_the_listed_classes_and_close_removes(family: str, invariant: bool, tokenizer) -> None:
    model = tiny_model(family, tokenizer)
    engine = Engine(model, tokenizer, batch_invariant=invariant)
    try:
        found = attentions(model)
        assert found and all(ours(m) for m in found) == (family != "glm")  # GLM: partial rotary, not listed
        generator = torch.Generator().manual_seed(1)
        segment = Segment(request_id=0, token_ids=[1, 2, 3, 4, 5], past_len=0, needs_logits=False)
        for module in found:
            hidden = torch.randn(1, 5, model.config.hidden_size, generator=generator)
            cos, sin = (torch.randn(1, 5, module.head_dim, generator=generator) for _ in range(2))
            kwargs = {"position_embeddings": (cos, sin), "attention_mask": None, "kev_pack": pack([segment])}
            with torch.inference_mode():
                assert torch.equal(module(hidden, **kwargs)[0], type(module).forward(module, hidden, **kwargs)[0])
    finally:
        engine.close()
    assert not any(ours(m) for m in model.modules())


def test_a_listed_class_whose_forward_changed_keeps_its_own(monkeypatch: pytest.MonkeyPatch, tokenizer,
                                                           caplog) -> None:
    """What a transformers release rewriting LlamaAttention would look like: Kev leaves it alone."""
    shipped = LlamaAttention.forward

    def scaled(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        out, weights = shipped(self, hidden_states, position_embeddings, attention_mask, **kwargs)
        return out * 0.5, weights

    model = tiny_model("llama", tokenizer)
    monkeypatch.setattr(LlamaAttention, "forward", scaled)
    with caplog.at_level("WARNING", logger="kev"):
        attention_forward.install(model, load_kernels().rotary)
    assert not any(ours(m) for m in attentions(model))
    said = "LlamaAttention keeps its own forward, not Kev's rotary kernel: its results differ"
    assert caplog.text.count(said) == 1  # checked once per class
    monkeypatch.undo()
    attention_forward.install(model, load_kernels().rotary)
    assert all(ours(m) for m in attentions(model))
    attention_forward.uninstall(model)
    assert not any(ours(m) for m in attentions(model))


def test_calls_it_cannot_take_go_to_the_class_forward(monkeypatch: pytest.MonkeyPatch, tokenizer) -> None:
    """cos/sin of another dtype than the input, or not one row per token (broadcast): the module's
    own forward, untouched."""
    model = tiny_model("llama", tokenizer)
    attention_forward.install(model, load_kernels().rotary)
    module = attentions(model)[0]
    calls = []
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",
                        lambda *args, **kwargs: calls.append(1) or apply_rotary_pos_emb(*args, **kwargs))
    hidden = torch.randn(1, 3, model.config.hidden_size)
    cos, sin = (torch.randn(1, 3, module.head_dim, dtype=torch.bfloat16) for _ in range(2))
    segment = Segment(request_id=0, token_ids=[1, 2, 3], past_len=0, needs_logits=False)
    with torch.inference_mode():
        module(hidden, position_embeddings=(cos, sin), attention_mask=None, kev_pack=pack([segment]))
    assert calls == [1]  # transformers' own rotary ran
    calls.clear()
    with torch.inference_mode():
        module(hidden, position_embeddings=(cos.float()[:, :1], sin.float()[:, :1]), attention_mask=None,
               kev_pack=pack([segment]))
    assert calls == [1]  # one position's cos/sin broadcast over the tokens: transformers' rotary too
    calls.clear()
    with torch.inference_mode():
        module(hidden, position_embeddings=(cos.float(), sin.float()), attention_mask=None, kev_pack=pack([segment]))
    assert calls == []  # the kernel's
