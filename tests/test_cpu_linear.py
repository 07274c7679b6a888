"""The few-rows Linear product (cpu_linear): equal to F.linear, installed and removed with the engine.

End to end, every isolation test compares an engine using it against an independent plain
transformers model that does not (reference_copy), on every family.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import QUESTIONS, reference_copy, reference_greedy, tiny_model

from kev_engine import Engine, SamplingParams, cpu_linear


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
    got = cpu_linear._forward(layer, max_rows, x)
    assert got.shape == (1, rows, 200) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=0)


def test_engine_installs_on_float32_cpu_and_close_removes(tokenizer) -> None:
    model = tiny_model("llama", tokenizer)
    engine = Engine(model, tokenizer)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    assert all(ours(m) is not None for m in linears)
    assert ours(head).args == (head, None)  # the output head: every row count
    assert {ours(m).args[1] for m in linears if m is not head} == {cpu_linear.MAX_ROWS}
    engine.close()
    assert not any("forward" in m.__dict__ for m in linears)
    x = torch.randn(1, 5, model.config.hidden_size)
    torch.testing.assert_close(head(x), F.linear(x, head.weight), atol=0, rtol=0)


def test_engine_leaves_other_forwards_and_dtypes_alone(tokenizer) -> None:
    model = tiny_model("llama", tokenizer)
    hooked = model.model.layers[0].self_attn.q_proj
    hook = hooked.forward = functools.partial(torch.nn.Linear.forward, hooked)  # as accelerate's hooks do
    engine = Engine(model, tokenizer)
    assert hooked.__dict__["forward"] is hook
    engine.close()
    assert hooked.__dict__["forward"] is hook

    half = tiny_model("llama", tokenizer).to(torch.bfloat16)
    engine = Engine(half, tokenizer)
    assert not any("forward" in m.__dict__ for m in half.modules())
    engine.close()


def test_decode_with_few_rows_matches_plain_model(tokenizer) -> None:
    """Two questions decode with 2-row passes (the W @ x.T branch) and match a plain model's greedy."""
    model = tiny_model("qwen2", tokenizer)
    reference = reference_copy(model)
    engine = Engine(model, tokenizer)
    try:
        prompts = QUESTIONS[:2]
        outs = engine.generate(prompts, sampling=SamplingParams(temperature=0, max_tokens=6))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == reference_greedy(reference, engine.encode(prompt), 6, tokenizer.eos_token_id)
    finally:
        engine.close()
