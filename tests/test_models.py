"""Kev's own model (kev_engine/models): its forward against transformers' for every family it owns,
from a transformers model and from a safetensors folder; the one-call layer against the op-by-op
layer, bitwise; `model_impl` and the transformers fallback, hooks honoured there."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import ROUNDING, rounding_tolerance, tiny_model

from kev_engine import Engine
from kev_engine.model.pack import Segment, pack
from kev_engine.models import FAMILIES, DecoderModel, Ops, choose_impl, from_folder, from_module
from kev_engine.platforms.cpu.kernels import load_kernels
from kev_engine.platforms.cpu.ops import ExactOps
from kev_engine.platforms.torch_ops import TorchBackend

OWNED = ["llama", "mistral", "qwen2", "qwen3"]
DTYPES = [torch.float32, torch.bfloat16]


def _one_pack(ids: list[int]) -> Any:
    return pack([Segment(request_id=0, token_ids=ids, past_len=0, needs_logits=True)], "cpu")


def _ids(tokenizer: Any, count: int = 12, seed: int = 0) -> list[int]:
    return torch.randint(0, len(tokenizer), (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", OWNED)
@pytest.mark.parametrize("ops", ["torch", "exact"])
def test_kevs_forward_computes_what_transformers_does(family: str, dtype: torch.dtype, ops: str,
                                                      tokenizer: Any) -> None:
    model = tiny_model(family, tokenizer, attention_bias=family == "llama").to(dtype)
    ids = _ids(tokenizer)
    expected = model(input_ids=torch.tensor([ids])).logits[0].float()  # [T, vocab]
    kev = from_module(model)
    if ops == "exact":
        kev.use(ExactOps(load_kernels()))
    got = kev.forward(_one_pack(ids), TorchBackend(), all_logits=True)
    if dtype == torch.float32 and ops == "torch":  # the same torch functions in the same order
        assert torch.equal(got, expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=rounding_tolerance(expected, dtype))
    assert ROUNDING[dtype] * expected.abs().max() < (expected - expected.roll(1, 0)).abs().max()  # the bound can fail


def test_a_changed_weight_is_seen(tokenizer: Any) -> None:
    """The control: Kev's forward reads the weights it was given, so one changed weight moves it."""
    model = tiny_model("qwen3", tokenizer)
    ids = _ids(tokenizer)
    before = from_module(model).forward(_one_pack(ids), TorchBackend(), all_logits=True)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_norm.weight[3] += 1.0
    after = from_module(model).forward(_one_pack(ids), TorchBackend(), all_logits=True)
    assert not torch.equal(before, after)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_from_a_safetensors_folder_equals_from_the_model(family: str, dtype: torch.dtype, tokenizer: Any,
                                                         tmp_path: Any) -> None:
    """Kev's reader (each tensor read from the file into its own memory) gives the tensors
    transformers' loading gives, in the checkpoint's dtype and converted to another."""
    model = tiny_model(family, tokenizer, tie_word_embeddings=family == "llama").to(dtype)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # shards and their index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = _ids(tokenizer)
    for wanted in DTYPES:
        folder = from_folder(tmp_path, wanted, torch.device("cpu"))
        assert folder.head.weight is folder.embed if family == "llama" else folder.head.weight is not folder.embed
        assert torch.equal(folder.forward(_one_pack(ids), TorchBackend(), all_logits=True),
                           from_module(model.to(wanted)).forward(_one_pack(ids), TorchBackend(), all_logits=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_one_call_layer_is_the_op_by_op_layer_bitwise(family: str, dtype: torch.dtype, tokenizer: Any) -> None:
    """A pass with LoRA rows runs each layer op by op, one without as one kernel call: a base
    question's bits must not depend on which (it shares passes with adapter questions)."""
    engine = Engine(tiny_model(family, tokenizer).to(dtype), tokenizer)
    try:
        model = engine.model
        assert isinstance(model, DecoderModel) and all(layer.native is not None for layer in model.layers)
        ids = _ids(tokenizer, 40)
        assert torch.equal(_pass(engine, ids, native=True), _pass(engine, ids, native=False))
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_layers_of_a_pass_in_one_call_are_a_call_per_layer_bitwise(dtype: torch.dtype, tokenizer: Any) -> None:
    """A whole pass hands the platform all its layers at once (`Ops.layers`: no return to Python
    between them); a pass paused between layers calls a layer at a time.
    The bits must not depend on which; the control drops a layer from the run and must differ."""
    engine = Engine(tiny_model("llama", tokenizer).to(dtype), tokenizer)
    ops = engine.model.ops
    layers, runs = ops.layers, []
    try:
        ids = _ids(tokenizer, 40)
        together = _pass(engine, ids, native=True)

        def apart(run: list[Any], hidden: torch.Tensor, *rest: Any) -> torch.Tensor:
            runs.append(len(run))
            for layer in run:
                hidden = layers([layer], hidden, *rest)
            return hidden

        ops.layers = apart
        assert torch.equal(_pass(engine, ids, native=True), together)
        assert runs == [len(engine.model.layers)]  # the whole pass was one run
        ops.layers = lambda run, *args: layers(run[:-1], *args)
        assert not torch.equal(_pass(engine, ids, native=True), together)
    finally:
        del ops.layers
        engine.close()


def _pass(engine: Engine, ids: list[int], native: bool) -> torch.Tensor:
    """Logits of `ids` as one fresh question in the engine's pool, each layer one call or op by op."""
    model, backend = engine.model, engine._backend
    blocks = list(range(-(-len(ids) // engine.stats()["kv_block_size"])))
    batch = pack([Segment(request_id=0, token_ids=ids, past_len=0, needs_logits=True, block_ids=blocks,
                          all_logits=True)], "cpu", backend)
    saved = [layer.native for layer in model.layers]
    if not native:
        for layer in model.layers:
            layer.native = None
    try:
        return model.forward(batch, backend, all_logits=True)
    finally:
        for layer, call in zip(model.layers, saved):
            layer.native = call


def test_model_impl_chooses_and_refuses(tokenizer: Any) -> None:
    llama, glm = tiny_model("llama", tokenizer).config, tiny_model("glm", tokenizer).config
    assert choose_impl(None, llama) == choose_impl("auto", llama) == "kev"
    assert choose_impl("auto", glm) == choose_impl("transformers", glm) == "transformers"
    with pytest.raises(ValueError, match=r"model_impl='kev' cannot serve this model: its family \('glm'\).*llama"):
        choose_impl("kev", glm)
    with pytest.raises(ValueError, match=r"model_impl='fast' is not allowed; use one of \['auto', 'kev', "):
        choose_impl("fast", llama)
    assert set(FAMILIES) == set(OWNED)


def test_the_engine_names_its_implementation(tokenizer: Any) -> None:
    with Engine(tiny_model("llama", tokenizer), tokenizer) as own, \
            Engine(tiny_model("llama", tokenizer), tokenizer, model_impl="transformers") as fallback:
        assert own.stats()["model_impl"] == "kev" and isinstance(own.model, DecoderModel)
        assert fallback.stats()["model_impl"] == "transformers" and isinstance(fallback.model, torch.nn.Module)
        prompts = ["Once upon a time", "The capital of France is"]
        # the same model both ways: the same greedy answers (bitwise in float32 on the invariant path)
        assert [c.token_ids for c in own.generate(prompts)] == [c.token_ids for c in fallback.generate(prompts)]


def test_the_fallback_runs_a_family_kev_does_not_own_with_its_hooks(tokenizer: Any) -> None:
    model = tiny_model("glm", tokenizer)
    called: list[int] = []
    model.model.layers[0].register_forward_hook(lambda module, args, out: called.append(1))
    with Engine(model, tokenizer) as engine:
        assert engine.stats()["model_impl"] == "transformers" and engine.model is model
        prompts = ["Once upon a time", "The capital of France is"]
        packed = engine.prompt_logits(prompts)
        alone = [engine.prompt_logits([p])[0] for p in prompts]
    assert called  # the hook ran on the fallback's passes
    for got, expected in zip(packed, alone):
        torch.testing.assert_close(got, expected, rtol=0, atol=rounding_tolerance(expected))


def test_a_lora_target_outside_kevs_parts_is_refused(tokenizer: Any, tmp_path: Any) -> None:
    """PEFT can target the output head; Kev's own model takes adapters on the layers' projections,
    and says so (the fallback serves the rest)."""
    import json

    from safetensors.torch import save_file

    from kev_engine.errors import AdapterError

    model = tiny_model("llama", tokenizer)
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["lm_head"]}))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.ones(2, 64),
               "base_model.model.lm_head.lora_B.weight": torch.ones(len(tokenizer), 2)},
              str(tmp_path / "adapter_model.safetensors"))
    with Engine(model, tokenizer) as engine, pytest.raises(AdapterError, match="q/k/v/o_proj and gate/up/down_proj"):
        engine.load_adapter("head", tmp_path)


def test_the_reference_ops_are_torchs(tokenizer: Any) -> None:
    assert Ops().name == "torch"
