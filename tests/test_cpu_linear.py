"""The few-rows Linear product of the non-invariant path (cpu_linear, and the compiled rows_linear
it calls): equal to F.linear, each row's result independent of the others, installed and removed
with an engine built with batch_invariant=False.

End to end, every isolation test compares an engine using it against an independent plain
transformers model that does not (reference_copy), on every family.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import QUESTIONS, reference_copy, reference_greedy, tiny_model

from kev_engine import Engine, SamplingParams
from kev_engine.platforms.cpu import rows_linear as cpu_linear
from kev_engine.platforms.cpu.kernels import load_kernels


def load_linear():
    return load_kernels().rows_linear


def ours(module: torch.nn.Module) -> functools.partial | None:
    forward = module.__dict__.get("forward")
    return forward if cpu_linear._is_ours(forward) else None


@pytest.mark.parametrize("rows", [1, 3, 16, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1, 100])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("max_rows", [cpu_linear.MAX_ROWS, None])
def test_forward_equals_linear(rows: int, bias: bool, max_rows: int | None) -> None:
    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 200, bias=bias)
    x = torch.randn(1, rows, 48)  # [batch, tokens, hidden] as a packed pass gives it
    got = cpu_linear._forward(layer, max_rows, None, x)
    assert got.shape == (1, rows, 200) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, cpu_linear.KERNEL_ROWS, cpu_linear.KERNEL_ROWS + 1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("features", [48, 40])  # 40: with AVX-512's 16 lanes, a last half vector
def test_compiled_forward_equals_linear(rows: int, bias: bool, features: int) -> None:
    torch.manual_seed(rows)
    layer = torch.nn.Linear(features, 200, bias=bias)  # 200 outputs: tiles of 3 (or 6) plus a remainder
    x = torch.randn(1, rows, features)
    got = cpu_linear._forward(layer, cpu_linear.MAX_ROWS, load_linear(), x)
    assert got.shape == (1, rows, 200) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=0)


def test_compiled_product_of_a_row_does_not_depend_on_the_other_rows() -> None:
    """Bitwise: a row packed with 1..31 others (every tile shape and remainder) gets what it gets alone."""
    torch.manual_seed(0)
    kernel = load_linear()
    for features in (64, 72):  # 72: with AVX-512's 16 lanes, a last half vector
        weight = torch.randn(101, features)
        x = torch.randn(cpu_linear.KERNEL_ROWS, features)
        alone = torch.cat([kernel(x[i : i + 1], weight) for i in range(len(x))])
        for rows in (2, 3, 4, 5, 7, 16, cpu_linear.KERNEL_ROWS):
            assert torch.equal(kernel(x[:rows], weight), alone[:rows]), rows
        assert torch.equal(kernel(x.flip(0), weight), alone.flip(0))  # and whatever its place in the pack


def test_compiled_product_refuses_what_it_cannot_compute() -> None:
    kernel = load_linear()
    with pytest.raises(RuntimeError, match="input has 12 features and the weight 12; both must match, a multiple of 8"):
        kernel(torch.randn(2, 12), torch.randn(5, 12))
    with pytest.raises(RuntimeError, match="input has 16 features and the weight 24"):
        kernel(torch.randn(2, 16), torch.randn(5, 24))
    with pytest.raises(RuntimeError, match="rows_linear takes float32, not BFloat16"):
        kernel(torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(5, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous weight"):
        kernel(torch.randn(2, 16), torch.randn(16, 5).t())


def test_engine_installs_on_float32_cpu_and_close_removes(tokenizer) -> None:
    model = tiny_model("llama", tokenizer)
    engine = Engine(model, tokenizer, batch_invariant=False, model_impl="transformers")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    assert all(ours(m) is not None for m in linears)
    assert ours(head).args == (head, None, load_linear())  # the output head: every row count
    assert {ours(m).args[1] for m in linears if m is not head} == {cpu_linear.MAX_ROWS}
    assert {ours(m).args[2] for m in linears} == {load_linear()}  # the compiled product ("auto" mode)
    engine.close()
    assert not any("forward" in m.__dict__ for m in linears)
    x = torch.randn(1, 5, model.config.hidden_size)
    torch.testing.assert_close(head(x), F.linear(x, head.weight), atol=0, rtol=0)


def test_engine_leaves_other_forwards_and_dtypes_alone(tokenizer) -> None:
    model = tiny_model("llama", tokenizer)
    hooked = model.model.layers[0].self_attn.q_proj
    hook = hooked.forward = functools.partial(torch.nn.Linear.forward, hooked)  # as accelerate's hooks do
    engine = Engine(model, tokenizer, batch_invariant=False, model_impl="transformers")
    assert hooked.__dict__["forward"] is hook
    engine.close()
    assert hooked.__dict__["forward"] is hook

    plain = tiny_model("llama", tokenizer)
    # no kernels: W @ x.T, MKL
    engine = Engine(plain, tokenizer, cpu_kernels="torch", batch_invariant=False, model_impl="transformers")
    assert {ours(m).args[2] for m in plain.modules() if isinstance(m, torch.nn.Linear)} == {None}
    engine.close()

    half = tiny_model("llama", tokenizer).to(torch.bfloat16)
    engine = Engine(half, tokenizer, batch_invariant=False, model_impl="transformers")
    assert not any("forward" in m.__dict__ for m in half.modules() if isinstance(m, torch.nn.Linear))
    engine.close()


def test_decode_with_few_rows_matches_plain_model(tokenizer) -> None:
    """Two questions decode with 2-row passes (the W @ x.T branch) and match a plain model's greedy."""
    model = tiny_model("qwen2", tokenizer)
    reference = reference_copy(model)
    engine = Engine(model, tokenizer, batch_invariant=False)
    try:
        prompts = QUESTIONS[:2]
        outs = engine.generate(prompts, sampling=SamplingParams(temperature=0, max_tokens=6))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(reference, engine.encode(prompt), 6, tokenizer.eos_token_id)
    finally:
        engine.close()
