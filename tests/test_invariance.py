"""Packed equals alone, bit for bit: `torch.equal` on the logits every token was sampled from, and
identical tokens, on four tiny families and the embedded model, in float32 and bfloat16.

Each case packs questions together (shared documents, a later call hitting the prefix cache,
chunked prefill, preemption, adapters, seeded sampling, a needle among 30 others) and compares
every question with the same question asked alone. The controls show these tests can fail, by
construction: the invariant engine with one reduction reordered by the pass's size
(`reorder_by_pass_size`) differs. (torch's own kernels, `batch_invariant=False`, differ too on a
CPU, but nothing guarantees they do: an H200 ran them invariantly on its shapes.)
"""

from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any

import pytest
import torch
from conftest import FAMILIES, tiny_model, two_adapters

from kev_engine import Engine, SamplingParams
from kev_engine.models import DecoderModel
from kev_engine.tools.verify import _run

DTYPES = [torch.float32, torch.bfloat16]
WORDS = ("the river rose after three days of rain and the old bridge near the mill was closed while "
         "engineers measured the stone arches and the town council met to discuss a new crossing").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def questions(seed: int, count: int, document_words: int = 60) -> list[Any]:
    """Chat questions of mixed lengths; the even ones share one document (a shared prefix)."""
    rng = random.Random(seed)
    document = text(rng, document_words)
    out: list[Any] = []
    for i in range(count):
        question = f"Question {i}: {text(rng, rng.randint(2, 25))}?"
        context = document if i % 2 == 0 else text(rng, rng.randint(5, 90))
        out.append([{"role": "user", "content": f"Context:\n{context}\n\n{question}"}])
    return out


def answers(engine: Engine, prompts: list[Any], sampling: list[SamplingParams], adapters: list[Any] | None = None):
    """(token ids, [tokens, vocab] logits each was sampled from) per prompt, all in one packed call."""
    return [(c.token_ids, logits) for c, logits in _run(engine, prompts, sampling, adapters or [None] * len(prompts))]


def alone(engine: Engine, prompts: list[Any], sampling: list[SamplingParams], adapters: list[Any] | None = None):
    """Each prompt in a call of its own, sharing no prefix with anything (a private cache_salt)."""
    out = []
    for i, prompt in enumerate(prompts):
        private = dataclasses.replace(sampling[i], cache_salt=f"alone-{i}-{random.random()}")
        out += answers(engine, [prompt], [private], None if adapters is None else [adapters[i]])
    return out


def differences(packed, solo) -> list[int]:
    """Indices of the questions whose tokens or logits are not bitwise the same."""
    return [i for i, ((t1, l1), (t2, l2)) in enumerate(zip(packed, solo))
            if t1 != t2 or l1.shape != l2.shape or not torch.equal(l1, l2)]


def greedy(count: int, max_tokens: int = 8) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens)] * count


def engine_for(family: str, tokenizer: Any, dtype: torch.dtype, **kwargs: Any) -> Engine:
    return Engine(tiny_model(family, tokenizer).to(dtype), tokenizer, name=family, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_equals_alone_bitwise_with_shared_documents(family: str, dtype: torch.dtype, tokenizer) -> None:
    engine = engine_for(family, tokenizer, dtype)
    try:
        assert engine.batch_invariant and engine.stats()["batch_invariant"] is True
        prompts = questions(1, 10)
        packed = answers(engine, prompts, greedy(10))
        assert engine.stats()["prefix_hit_tokens"] > 0  # the document was computed once and shared
        assert differences(packed, alone(engine, prompts, greedy(10))) == []
        # a later call hits the cache that one left: still bitwise the same
        before = engine.stats()["prefix_hit_tokens"]
        again = answers(engine, prompts[:3], greedy(3))
        assert engine.stats()["prefix_hit_tokens"] > before
        assert differences(again, packed[:3]) == []
    finally:
        engine.close()


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "control"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_equals_alone(family: str, dtype: torch.dtype, invariant: bool, tokenizer) -> None:
    """Prompts cut in 16-token chunks against each alone in an unchunked engine. The control
    reorders a reduction by the pass's row count in both engines (`reorder_by_pass_size`), so
    16-row chunks and whole prompts sum differently by construction: the comparison can fail."""
    prompts = questions(2, 8, document_words=40)
    whole = engine_for(family, tokenizer, dtype)
    chunked = engine_for(family, tokenizer, dtype, max_batch_tokens=16, max_num_seqs=4)
    if not invariant:
        reorder_by_pass_size(whole.model)
        reorder_by_pass_size(chunked.model)
    try:
        found = differences(answers(chunked, prompts, greedy(8, 12)), alone(whole, prompts, greedy(8, 12)))
        assert chunked.stats()["prefill_passes"] > 8
        assert (found == []) if invariant else (found != [])
    finally:
        whole.close()
        chunked.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "glm"])
def test_preempted_questions_equal_alone(family: str, dtype: torch.dtype, tokenizer) -> None:
    """A pool so small that questions are preempted and recomputed: every answer is what the
    question gets alone in an engine with room to spare."""
    prompts = questions(2, 8, document_words=40)
    roomy = engine_for(family, tokenizer, dtype)
    tight = engine_for(family, tokenizer, dtype, kv_cache_bytes=24 * roomy._kv.block_bytes)
    try:
        solo = alone(roomy, prompts, greedy(8, 24))
        assert differences(answers(tight, prompts, greedy(8, 24)), solo) == []
        assert tight.stats()["preemptions"] > 0
    finally:
        roomy.close()
        tight.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_per_question_adapters_equal_alone(dtype: torch.dtype, tokenizer, tmp_path) -> None:
    base = tiny_model("qwen2", tokenizer)
    folders = two_adapters(base, tmp_path)
    engine = Engine(base.to(dtype), tokenizer)
    try:
        for name, folder in folders.items():
            engine.load_adapter(name, str(folder))
        prompts = questions(3, 9)
        names = [("qv", "all", None)[i % 3] for i in range(9)]
        packed = answers(engine, prompts, greedy(9), names)
        assert differences(packed, alone(engine, prompts, greedy(9), names)) == []
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_seeded_sampling_at_temperature_equals_alone(dtype: torch.dtype, tokenizer) -> None:
    engine = engine_for("llama", tokenizer, dtype)
    try:
        prompts = questions(4, 8)
        sampling = [SamplingParams(temperature=0.9, top_p=0.95, top_k=(0, 40)[i % 2], seed=100 + i, max_tokens=12)
                    for i in range(8)]
        packed = answers(engine, prompts, sampling)
        assert differences(packed, alone(engine, prompts, sampling)) == []
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_needle_in_a_batch(family: str, dtype: torch.dtype, tokenizer) -> None:
    """One question at a random place among 30 others of random lengths, 5 trials: bitwise the
    same as alone every time (vLLM's test of batch invariance, on CPU)."""
    engine = engine_for(family, tokenizer, dtype)
    rng = random.Random(7)
    try:
        needle = questions(5, 1)[0]
        solo = alone(engine, [needle], greedy(1, 16))
        for trial in range(5):
            haystack = [[{"role": "user", "content": text(rng, rng.randint(1, 150))}] for _ in range(30)]
            at = rng.randrange(31)
            prompts = haystack[:at] + [needle] + haystack[at:]
            packed = answers(engine, prompts, greedy(31, 16))
            assert differences([packed[at]], solo) == [], f"trial {trial}: needle at {at}"
    finally:
        engine.close()


@pytest.fixture(scope="module", params=DTYPES, ids=["fp32", "bf16"])
def embedded(request) -> Engine:
    engine = Engine.from_pretrained(dtype=request.param)
    yield engine
    engine.close()


def doc_questions() -> list[Any]:
    document = ("The Harbour Museum opened in 1998 in a former customs house on the north quay. Its three floors "
                "hold ship models, navigation instruments and a lighthouse lens from 1874. Admission is free on "
                "Sundays; on other days an adult ticket costs 8 euros. The museum is closed on Mondays. ") * 3
    asks = ["When did the museum open?", "What does an adult ticket cost?", "When is it closed?",
            "What is on the three floors?", "Is admission ever free?", "Where is the museum?"]
    return [[{"role": "system", "content": "Answer briefly from the context."},
             {"role": "user", "content": f"Context:\n{document}\n\nQuestion: {q}"}] for q in asks]


def test_embedded_model_packed_equals_alone_bitwise(embedded: Engine) -> None:
    """Six questions about one document (computed once, read by the others in the same pass)."""
    assert embedded.batch_invariant
    prompts = doc_questions()
    packed = answers(embedded, prompts, greedy(6, 12))
    assert embedded.stats()["prefix_hit_tokens"] > 0
    assert differences(packed, alone(embedded, prompts, greedy(6, 12))) == []
    assert len({tuple(tokens) for tokens, _ in packed}) > 1  # each question got its own answer


def reorder_by_pass_size(model: Any) -> None:
    """Break invariance on purpose: every MLP's down projection sums its K products in two parts
    split at a place that moves with the pass's row count (each part rounded in the model's
    dtype, then added) — the kind of order a BLAS picks by shape, here by construction. On Kev's
    model its ops' product is replaced for the down projections (each layer then runs op by op);
    on the transformers fallback the modules' forwards."""
    def split_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        k = x.shape[-1]
        split = 1 + x.shape[-2] % (k - 1)
        return (torch.nn.functional.linear(x[..., :split], weight[:, :split])
                + torch.nn.functional.linear(x[..., split:], weight[:, split:], bias))

    if isinstance(model, DecoderModel):
        product = model.ops.linear
        weights: dict[int, torch.Tensor] = {}  # each down projection's W, from its packed form
        for layer in model.layers:
            eye = torch.eye(layer.down.in_features, dtype=model.dtype, device=model.device)
            weights[id(layer.down)] = product(eye, layer.down).T.contiguous()  # one product per entry: W exactly

        def linear(x: torch.Tensor, part: Any, prompt: torch.Tensor | None = None) -> torch.Tensor:
            weight = weights.get(id(part))
            return product(x, part, prompt) if weight is None else split_product(x, weight, part.bias)

        model.ops.linear = linear
        for layer in model.layers:
            layer.native = None
        return
    for name, module in model.named_modules():
        if name.endswith("mlp.down_proj"):
            module.forward = functools.partial(lambda layer, x: split_product(x, layer.weight, layer.bias), module)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_control_a_reduction_ordered_by_the_pass_is_caught(dtype: torch.dtype) -> None:
    """The shared-document comparison can fail, whatever the machine's BLAS: the invariant engine
    with one reduction reordered by the pass's size (`reorder_by_pass_size`) differs packed."""
    control = Engine.from_pretrained(dtype=dtype)
    try:
        assert control.batch_invariant
        reorder_by_pass_size(control.model)
        prompts = doc_questions()
        assert differences(answers(control, prompts, greedy(6, 12)), alone(control, prompts, greedy(6, 12))) != []
    finally:
        control.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_control_on_every_family_a_reordered_reduction_is_caught(family: str, tokenizer) -> None:
    """The tiny families' shared-document comparison, with the constructed control."""
    engine = engine_for(family, tokenizer, torch.float32)
    try:
        reorder_by_pass_size(engine.model)
        prompts = questions(1, 10)
        assert differences(answers(engine, prompts, greedy(10)), alone(engine, prompts, greedy(10))) != []
    finally:
        engine.close()


def chunked_against_alone(dtype: torch.dtype, reordered: bool = False) -> list[int]:
    """The document questions prefilled 64 tokens a pass against each alone in an unchunked engine
    (`reordered`: both with a reduction split by the pass's row count, `reorder_by_pass_size`)."""
    chunked = Engine.from_pretrained(dtype=dtype, max_batch_tokens=64, max_num_seqs=8)
    whole = Engine.from_pretrained(dtype=dtype)
    if reordered:
        reorder_by_pass_size(chunked.model)
        reorder_by_pass_size(whole.model)
    try:
        prompts = doc_questions()
        found = differences(answers(chunked, prompts, greedy(6, 12)), alone(whole, prompts, greedy(6, 12)))
        assert chunked.stats()["prefill_passes"] > 6
        return found
    finally:
        chunked.close()
        whole.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_embedded_model_chunked_prefill_equals_alone_bitwise(dtype: torch.dtype) -> None:
    assert chunked_against_alone(dtype) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_control_a_reduction_split_by_row_count_is_found_on_the_embedded_model(dtype: torch.dtype) -> None:
    """The test above can fail: with a reduction whose order moves with the pass's row count (the
    kind of order a BLAS picks by shape, here by construction), the same comparison differs."""
    assert chunked_against_alone(dtype, reordered=True) != []


def test_batch_invariant_true_says_why_it_cannot_be(tokenizer) -> None:
    model = tiny_model("llama", tokenizer)
    with pytest.raises(ValueError, match="batch_invariant=True cannot be honoured: Kev's compiled CPU kernels"):
        Engine(model, tokenizer, cpu_kernels="torch", batch_invariant=True)
    with pytest.raises(ValueError, match=r"the model is in torch.float16; the batch-invariant kernels compute"):
        Engine(model.to(torch.float16), tokenizer, batch_invariant=True)
    with pytest.raises(TypeError, match="batch_invariant='yes' is not allowed"):
        Engine(model, tokenizer, batch_invariant="yes")  # type: ignore[arg-type]
    engine = Engine(model, tokenizer, cpu_kernels="torch")  # None: wherever possible — here it is not
    assert engine.stats()["batch_invariant"] is False and engine.stats()["dtype"] == "float16"
    engine.close()


def test_an_activation_without_a_kernel_is_said(tokenizer, caplog) -> None:
    """A gelu MLP keeps torch's activation on the batch-invariant path, and the engine says which."""
    with caplog.at_level("WARNING", logger="kev"):
        engine = Engine(tiny_model("llama", tokenizer, hidden_act="gelu"), tokenizer)
    try:
        assert engine.batch_invariant
        assert "keep torch's own elementwise code" in caplog.text and "model.layers.0.mlp" in caplog.text
    finally:
        engine.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="kev"):
        Engine(tiny_model("llama", tokenizer), tokenizer).close()  # silu: the kernel, nothing to say
    assert "elementwise" not in caplog.text


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_norms_silu_and_rotary_are_per_row(dtype: torch.dtype, tokenizer) -> None:
    """The per-row pieces, alone against inside packs of many sizes (past torch's parallel grain,
    odd and even), bitwise: RMSNorm (torch's, through Kev's in-place form, and Kev's rms_norm
    kernel), Kev's silu_mul, and the rotary table against the module's own forward for the same
    positions."""
    from kev_engine.platforms import inplace, rotary_table
    from kev_engine.platforms.cpu.kernels import load_kernels

    model = tiny_model("llama", tokenizer, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                       num_key_value_heads=3).to(dtype)
    kernels = load_kernels()
    norm, silu_mul = model.model.norm, kernels.silu_mul
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5, generator=torch.Generator().manual_seed(3))  # not all ones: the product counts
    kernel_norm = functools.partial(inplace._rms_norm_kernel, norm, kernels.rms_norm)
    torch.manual_seed(0)
    rows = (torch.randn(4097, 576) * 3).to(dtype)
    gate, up = torch.randn(4097, 1536).to(dtype), torch.randn(4097, 1536).to(dtype)
    with torch.inference_mode():
        alone_norm = torch.cat([inplace._rms_norm_forward(norm, rows[i : i + 1]) for i in (0, 1, 4096)])
        alone_kernel_norm = torch.cat([kernel_norm(rows[i : i + 1]) for i in (0, 1, 4096)])
        alone_act = torch.empty(3, 1536, dtype=dtype)
        for j, i in enumerate((0, 1, 4096)):
            silu_mul(gate[i : i + 1], up[i : i + 1], alone_act[j : j + 1])
        for count in (2, 3, 511, 4097):
            packed = inplace._rms_norm_forward(norm, rows[:count])
            packed_kernel_norm = kernel_norm(rows[:count])
            act = torch.empty(count, 1536, dtype=dtype)
            silu_mul(gate[:count], up[:count], act)
            picks = [0, 1] + ([4096] if count == 4097 else [])
            assert torch.equal(packed[picks], alone_norm[: len(picks)]), count
            assert torch.equal(packed_kernel_norm[picks], alone_kernel_norm[: len(picks)]), count
            assert torch.equal(act[picks], alone_act[: len(picks)]), count
        expected = (torch.nn.functional.silu(gate.float()) * up.float())[[0, 1, 4096]]
        torch.testing.assert_close(alone_act.float(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                                   atol=1e-5)
        # the kernel's norm is torch's formula up to the order of the squares' sum (and bf16's rounding)
        torch.testing.assert_close(alone_kernel_norm, alone_norm, rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-5)
        rotary = model.model.rotary_emb
        positions = torch.tensor([[0, 5, 1023, 1024, 3000]])
        own_cos, own_sin = type(rotary).forward(rotary, rows[:1], positions)
        rotary_table.install(model)
        try:
            cos, sin = rotary(rows[:1], positions)
            assert cos.dtype == dtype and cos.shape == own_cos.shape
            torch.testing.assert_close(cos, own_cos, atol=1e-6, rtol=0)  # the module's own values, to rounding
            torch.testing.assert_close(sin, own_sin, atol=1e-6, rtol=0)
            for p in positions[0].tolist():  # one position alone: the same as among the others
                alone_cos, alone_sin = rotary(rows[:1], torch.tensor([[p]]))
                column = positions[0].tolist().index(p)
                assert torch.equal(alone_cos[0, 0], cos[0, column]) and torch.equal(alone_sin[0, 0], sin[0, column])
        finally:
            rotary_table.uninstall(model)
