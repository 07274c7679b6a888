"""The model's pass as Kev's calls alone (kev_engine.platforms.cpu.model_forward): bitwise the
model's own forward on every listed family in both dtypes, checked on the first decode pass it
fits and dropped for good where that check differs, and left for the model's forward where a
pass cannot take it (a LoRA-wrapped projection, a hook — also one registered on a layer's part
while the engine runs —, the fast path, a first pass too big to check twice).

End to end, every isolation and invariance test of the batch-invariant CPU path runs engines
that use it, against plain transformers models and against themselves alone.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from conftest import FAMILIES, tiny_model

from kev_engine import Engine, SamplingParams
from kev_engine.adapters.lora import LoraRouter, wrap_targets
from kev_engine.platforms.cpu import model_forward
from kev_engine.platforms.cpu.model_forward import ModelForward

PROMPTS = [[{"role": "user", "content": f"Question {i}: " + "where does the river go " * (2 + 3 * i)}]
           for i in range(3)]


def _logits(engine: Engine, salt: str) -> list[torch.Tensor]:
    sampling = SamplingParams(temperature=0, max_tokens=5, cache_salt=salt)
    return [logits for _, logits in engine.generate_with_logits(PROMPTS, [sampling] * len(PROMPTS),
                                                                [None] * len(PROMPTS))]


def _counted(direct: ModelForward) -> list[int]:
    """The token counts of the passes `direct` runs from now on."""
    passes: list[int] = []
    run = direct.run

    def counted(batch):
        passes.append(batch.num_tokens)
        return run(batch)

    direct.run = counted  # type: ignore[method-assign]
    return passes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "glm"])
def test_the_direct_pass_is_the_models_forward_bitwise(family: str, dtype: torch.dtype, tokenizer) -> None:
    """Prefill and decode passes of a pack through Kev's calls alone against the same passes
    through the model's forward: torch.equal on every logit. The control, the direct pass
    without its last layer, differs: the comparison sees one layer."""
    engine = Engine(tiny_model(family, tokenizer).to(dtype), tokenizer)
    try:
        direct = engine._runner.direct
        assert isinstance(direct, ModelForward)
        engine.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0, max_tokens=2))
        assert direct.checked is True  # on its first decode pass
        passes = _counted(direct)
        ours = _logits(engine, "direct")
        assert len(passes) == 5 and passes[0] > model_forward.CHECK_ROWS  # the prompts' pass and 4 decode steps
        engine._runner.direct = None
        assert all(torch.equal(a, b) for a, b in zip(ours, _logits(engine, "model"), strict=True))
        short = ModelForward(engine.model, direct.backend)
        short.checked = True  # run as checked: what a wrong pass would return
        found = short._layers
        short._layers = lambda: (found() or [])[:-1]  # type: ignore[method-assign]
        engine._runner.direct = short
        assert not all(torch.equal(a, b) for a, b in zip(ours, _logits(engine, "control"), strict=True))
    finally:
        engine.close()


def test_a_first_check_that_differs_turns_it_off(monkeypatch: pytest.MonkeyPatch, tokenizer, caplog) -> None:
    """What a transformers release whose model forward computes something else would look like:
    the checking pass answers with the model's own logits, a warning says why, and no later pass
    takes the direct one."""
    engine = Engine(tiny_model("llama", tokenizer), tokenizer)
    try:
        direct = engine._runner.direct
        assert isinstance(direct, ModelForward)
        run = direct._run
        monkeypatch.setattr(direct, "_run", lambda batch: run(batch) * 0.5)
        passes = _counted(direct)
        with caplog.at_level("WARNING", logger="kev"):
            ours = _logits(engine, "changed")
        assert direct.checked is False and len(passes) == 1
        assert caplog.text.count("no longer computes what Kev's direct pass does") == 1
        engine._runner.direct = None
        assert all(torch.equal(a, b) for a, b in zip(ours, _logits(engine, "model"), strict=True))
    finally:
        engine.close()


def test_passes_it_cannot_take_go_through_the_model(monkeypatch: pytest.MonkeyPatch, tokenizer) -> None:
    """Before the check, a prompt's pass or more decode rows than `CHECK_ROWS` (either would run
    twice); a forward hook on the model; a projection wrapped for LoRA: the model's forward. The
    fast path has no direct pass."""
    engine = Engine(tiny_model("llama", tokenizer), tokenizer)
    try:
        direct = engine._runner.direct
        assert isinstance(direct, ModelForward)
        passes = _counted(direct)
        monkeypatch.setattr(model_forward, "CHECK_ROWS", 2)
        engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3, cache_salt="three"))
        assert passes == [] and direct.checked is None  # a prompts' pass, then decode passes of 3 rows
        monkeypatch.undo()
        handle = engine.model.register_forward_hook(lambda module, args, out: out)
        engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, cache_salt="hooked"))
        assert passes == []
        handle.remove()
        engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, cache_salt="plain"))
        assert passes == [1, 1] and direct.checked is True  # its prompt came before the check
        wrap_targets(engine.model, ["model.layers.0.self_attn.q_proj"], LoraRouter())
        engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, cache_salt="wrapped"))
        assert passes == [1, 1]
    finally:
        engine.close()
    fast = Engine(tiny_model("llama", tokenizer), tokenizer, batch_invariant=False)
    try:
        assert fast._runner.direct is None
    finally:
        fast.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("where", ["input_layernorm", "self_attn", "self_attn.q_proj", "mlp", "mlp.down_proj",
                                   "mlp.act_fn", "every module"])
def test_a_hook_registered_while_it_runs_is_called(where: str, dtype: torch.dtype, tokenizer) -> None:
    """A forward hook registered after the engine started, on a part of a decoder layer or for
    every module (capturing activations, say), is called on every pass, and those passes go
    through the modules' own calls: the same logits bitwise (the hook returns nothing), except where
    the activation itself is hooked (its own hook, or one for every module): it is then called, so
    torch's silu, not the kernel's. Removed,
    the direct pass takes the passes again. Without the check, no pass called such a hook: the
    direct pass and a layer's one function call the parts' forwards, not the parts."""
    engine = Engine(tiny_model("llama", tokenizer).to(dtype), tokenizer)
    try:
        direct = engine._runner.direct
        assert isinstance(direct, ModelForward)
        engine.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0, max_tokens=2))
        passes = _counted(direct)
        before = _logits(engine, "before")
        assert len(passes) == 5  # the prompts' pass and 4 decode steps
        calls: list[str] = []

        def hook(module: torch.nn.Module, args: object, out: object) -> None:
            calls.append(type(module).__name__)

        if where == "every module":
            handle = torch.nn.modules.module.register_module_forward_hook(hook)
        else:
            handle = engine.model.model.layers[1].get_submodule(where).register_forward_hook(hook)
        try:
            hooked = _logits(engine, "hooked")
        finally:
            handle.remove()
        assert len(passes) == 5  # no pass took the direct one
        if where == "every module":
            assert {"LlamaRMSNorm", "LlamaAttention", "Linear", "LlamaMLP"} <= set(calls)
        else:
            assert len(calls) == 5  # once a pass
        if where not in ("mlp.act_fn", "every module"):  # a hooked activation is torch's silu, not the kernel's
            assert all(torch.equal(a, b) for a, b in zip(before, hooked, strict=True))
        _logits(engine, "after")
        assert len(passes) == 10
    finally:
        engine.close()


class _Skip(torch.nn.Module):
    """A decoder layer that passes its input on."""

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return hidden_states


def test_a_norm_weight_or_layer_replaced_while_it_runs_is_seen(tokenizer) -> None:
    """What the direct pass holds (each norm's weight, each layer where it was) replaced while the
    engine runs: passes go through the model, the same logits bitwise where the values are the
    same; put back, the direct pass takes them again."""
    engine = Engine(tiny_model("llama", tokenizer), tokenizer)
    try:
        direct = engine._runner.direct
        assert isinstance(direct, ModelForward)
        engine.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0, max_tokens=2))
        passes = _counted(direct)
        before = _logits(engine, "before")
        layers = engine.model.model.layers
        norm = layers[1].post_attention_layernorm
        weight = norm.weight
        norm.weight = torch.nn.Parameter(weight.detach().clone())
        assert all(torch.equal(a, b) for a, b in zip(before, _logits(engine, "new weight"), strict=True))
        assert len(passes) == 5
        norm.weight = weight
        _logits(engine, "weight back")
        assert len(passes) == 10
        layer = layers[1]
        layers[1] = _Skip()  # a layer gone: the model computes something else
        _logits(engine, "no layer")
        assert len(passes) == 10
        layers[1] = layer
        assert all(torch.equal(a, b) for a, b in zip(before, _logits(engine, "put back"), strict=True))
        assert len(passes) == 15
    finally:
        engine.close()


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_what_a_hook_keeps_is_never_written_over(invariant: bool, tokenizer) -> None:
    """A hook may keep the tensor it is handed without a copy (gate_proj's output, the activation's):
    Kev's MLP computes its activation and product in place, but never over those, so each kept
    tensor still equals the copy taken when it was handed over. With gate_proj hooked the logits
    stay bitwise those of no hook (the same arithmetic into a new tensor). And an activation put in
    place while the engine runs (GELU for SiLU) is the one computed: the logits move (they did not)."""
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, batch_invariant=invariant)
    try:
        mlp = engine.model.model.layers[1].mlp
        plain = _logits(engine, "plain")
        for hooked, salt in (((mlp.gate_proj,), "gate"), ((mlp.gate_proj, mlp.act_fn), "both")):
            kept: list[tuple[torch.Tensor, torch.Tensor]] = []
            def keep(module: torch.nn.Module, args: object, out: torch.Tensor, kept: list = kept) -> None:
                kept.append((out, out.clone()))

            handles = [module.register_forward_hook(keep) for module in hooked]
            try:
                logits = _logits(engine, salt)
            finally:
                for handle in handles:
                    handle.remove()
            assert len(kept) == 5 * len(hooked) and all(torch.equal(out, copy) for out, copy in kept)
            if salt == "gate":
                assert all(torch.equal(a, b) for a, b in zip(plain, logits, strict=True))
        mlp.act_fn = torch.nn.GELU()
        assert not any(torch.equal(a, b) for a, b in zip(plain, _logits(engine, "gelu"), strict=True))
    finally:
        engine.close()


def test_a_hook_table_replaced_wholesale_is_seen(tokenizer) -> None:
    """Code that clears a module's hooks by giving it a new table (`_forward_hooks = OrderedDict()`)
    and then registers one into it: the hook is called, the pass goes through the modules."""
    engine = Engine(tiny_model("llama", tokenizer), tokenizer)
    try:
        direct = engine._runner.direct
        assert isinstance(direct, ModelForward)
        engine.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0, max_tokens=2))
        passes = _counted(direct)
        _logits(engine, "before")
        assert len(passes) == 5
        calls: list[int] = []
        for module in (engine.model.model.layers[1], engine.model.model.layers[1].self_attn.q_proj):
            module._forward_hooks = OrderedDict()
            handle = module.register_forward_hook(lambda module, args, out: calls.append(1))
            try:
                _logits(engine, f"new table {len(calls)}")
            finally:
                handle.remove()
        assert len(passes) == 5 and len(calls) == 10
    finally:
        engine.close()


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "fast"])
def test_glms_activation_hooked_is_called(invariant: bool, tokenizer) -> None:
    """GLM's fused MLP (`gate_up_proj`, then the kernel's silu and product) calls its activation
    once it is hooked: once a pass."""
    engine = Engine(tiny_model("glm", tokenizer), tokenizer, batch_invariant=invariant)
    try:
        calls: list[int] = []
        handle = engine.model.model.layers[0].mlp.activation_fn.register_forward_hook(
            lambda module, args, out: calls.append(1))
        try:
            _logits(engine, "hooked")
        finally:
            handle.remove()
        assert len(calls) == 5
    finally:
        engine.close()
