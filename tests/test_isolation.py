"""Packed == solo, on several model families: the property Kev exists for.

Each test packs several questions into one pass and compares every question with a plain
transformers forward / generate of that question alone (independent model, same weights).
"""

from __future__ import annotations

import pytest
import torch
from conftest import QUESTIONS, chat, reference_copy, reference_greedy, rounding_tolerance, tiny_model

from kev_engine import Engine, SamplingParams
from kev_engine.platforms.torch_ops import TorchBackend

ATOL = 1e-4


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_packed_logits_equal_solo_forward(family_pair) -> None:
    engine, reference = family_pair
    packed = engine.prompt_logits(QUESTIONS)
    assert engine.stats()["prefill_passes"] == 1
    for prompt, logits in zip(QUESTIONS, packed):
        expected = reference_logits(reference, engine.encode(prompt))
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_packed_greedy_tokens_equal_solo_generate(family_pair) -> None:
    engine, reference = family_pair
    params = SamplingParams(temperature=0, max_tokens=12)
    results = engine.generate(QUESTIONS, params)
    assert engine.stats()["prefill_passes"] == 1  # all questions in ONE prefill pass
    for prompt, result in zip(QUESTIONS, results):
        expected = reference_greedy(reference, engine.encode(prompt), 12, engine.tokenizer.eos_token_id)
        assert result.token_ids == expected
        assert result.prompt_tokens == len(engine.encode(prompt))
    engine.close()


def test_embedded_model_packed_equals_solo(embedded_engine: Engine, embedded_reference) -> None:
    prompts = QUESTIONS[:4]
    for prompt, logits in zip(prompts, embedded_engine.prompt_logits(prompts)):
        expected = reference_logits(embedded_reference, embedded_engine.encode(prompt))
        torch.testing.assert_close(logits, expected, atol=rounding_tolerance(expected, embedded_engine.dtype), rtol=0)
    results = embedded_engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    eos = embedded_engine.tokenizer.eos_token_id
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference_greedy(embedded_reference, embedded_engine.encode(prompt), 16, eos)


def test_the_rounding_tolerance_still_sees_one_changed_token(embedded_engine: Engine, embedded_reference) -> None:
    """The control for every comparison within `rounding_tolerance`: the logits of a question
    whose context differs by one word are far outside it (as a leak from a neighbour would be),
    while two correct computations of the same question are inside it."""
    question = chat("Where is the lighthouse?", "The lighthouse stands on the northern cape of the island.")
    changed = chat("Where is the lighthouse?", "The lighthouse stands on the southern cape of the island.")
    expected = reference_logits(embedded_reference, embedded_engine.encode(question))
    tolerance = rounding_tolerance(expected, embedded_engine.dtype)
    other = reference_logits(embedded_reference, embedded_engine.encode(changed))
    assert other.shape == expected.shape
    assert (other - expected).abs().max().item() > 10 * tolerance
    assert (embedded_engine.prompt_logits([question])[0] - expected).abs().max().item() <= tolerance


def test_canary_secret_never_reaches_the_other_question(embedded_engine: Engine) -> None:
    secret = chat("Repeat the secret code exactly.", "The secret code is ZEBRA-4471. Never forget ZEBRA-4471.")
    probe = chat("What is the secret code? Repeat it exactly.", "There is no code in this context.")
    blank = chat("Repeat the secret code exactly.", "The secret code is not written here. Nothing to see.")
    greedy = SamplingParams(temperature=0, max_tokens=24)
    with_secret = embedded_engine.generate([secret, probe], greedy)
    without_secret = embedded_engine.generate([blank, probe], greedy)
    assert "ZEBRA" in with_secret[0].text  # the model does read its own context...
    assert "ZEBRA" not in with_secret[1].text  # ...and the neighbour never sees it
    assert with_secret[1].token_ids == without_secret[1].token_ids
    solo = embedded_engine.prompt_logits([probe])[0]
    packed = embedded_engine.prompt_logits([secret, probe])[1]
    assert torch.equal(packed, solo)  # bit for bit: the engine is batch-invariant


def test_perturbing_b_at_same_length_leaves_a_bit_identical(tokenizer) -> None:
    engine = Engine(tiny_model("qwen2", tokenizer), tokenizer)
    a = engine.encode(chat("Tell me about owls."))
    b = engine.encode(chat("Tell me about cats and dogs and birds."))
    b_changed = [(t + 1) % len(tokenizer) for t in b]  # every token differs, same length
    assert len(b_changed) == len(b) and all(x != y for x, y in zip(b, b_changed))
    text_b, text_b2 = tokenizer.decode(b), tokenizer.decode(b_changed)
    # prompt_logits takes prompts, so feed raw ids through a model-level pack instead
    from kev_engine.model.pack import Segment, pack

    def a_logits(other: list[int]) -> torch.Tensor:
        batch = pack([Segment(0, other, 0, True), Segment(1, a, 0, True)])
        return engine.model.forward(batch, TorchBackend(), all_logits=True)[len(other):]

    assert text_b != text_b2
    assert torch.equal(a_logits(b), a_logits(b_changed))  # bit for bit
    longer = b + b[:7]
    torch.testing.assert_close(a_logits(longer), a_logits(b), atol=ATOL, rtol=0)


def test_changing_b_keeps_a_generation_identical(tiny_engine: Engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=10)
    a = chat("Describe the moon.")
    first = tiny_engine.generate([a, chat("Short.")], params)[0]
    second = tiny_engine.generate([chat("A much longer question about many different things " * 5), a], params)[1]
    assert first.token_ids == second.token_ids


def test_chunked_prefill_equals_solo(tokenizer) -> None:
    model = tiny_model("llama", tokenizer)
    reference = reference_copy(model)
    engine = Engine(model, tokenizer, max_batch_tokens=16, max_num_seqs=4)  # prompts span several passes
    prompts = [QUESTIONS[1], QUESTIONS[4], QUESTIONS[2]]
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    for prompt, result in zip(prompts, results):
        ids = engine.encode(prompt)
        assert result.token_ids == reference_greedy(reference, ids, 6, tokenizer.eos_token_id)
    assert engine.stats()["prefill_passes"] > 1
    engine.close()


def test_bfloat16_packed_equals_transformers_within_dtype_tolerance_and_solo_bitwise(tokenizer) -> None:
    model = tiny_model("qwen3", tokenizer).to(torch.bfloat16)
    reference = reference_copy(model).to(torch.bfloat16)
    engine = Engine(model, tokenizer)
    eps = torch.finfo(torch.bfloat16).eps  # 2**-7: a few ulps of the logits' scale
    for prompt, logits in zip(QUESTIONS, engine.prompt_logits(QUESTIONS)):
        expected = reference_logits(reference, engine.encode(prompt))
        scale = expected.abs().max().item()
        torch.testing.assert_close(logits, expected, atol=4 * eps * scale, rtol=0)
    # the solo engine pass is the bit-level reference: batch-invariant kernels, same dtype
    assert engine.batch_invariant
    packed = engine.prompt_logits(QUESTIONS)
    for prompt, logits in zip(QUESTIONS, packed):
        assert torch.equal(logits, engine.prompt_logits([prompt])[0])


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_decode_row_sharing_a_pass_with_a_prefill_equals_solo(tokenizer, path: str) -> None:
    """A pass of decode rows alone and a pass where a prefill joins them take different code
    (no gather/scatter of rows in the first): both give each question its solo greedy tokens."""
    model = tiny_model("llama", tokenizer)
    reference = reference_copy(model)
    engine = Engine(model, tokenizer, cpu_kernels=path)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    try:
        with engine.hold():
            first = engine.submit(QUESTIONS[0], greedy)
            engine.step()  # its prefill
            engine.step()  # a pass of decode rows alone
            late = engine.submit(QUESTIONS[1], greedy)
            before = engine.stats()
            engine.step()  # the late prefill and the running decode row in one pass
            after = engine.stats()
            assert after["forward_passes"] == before["forward_passes"] + 1
            assert after["prefill_passes"] == before["prefill_passes"] + 1
            assert after["decode_steps"] == before["decode_steps"]  # disjoint: a prefill pass
            assert after["generated_tokens"] == before["generated_tokens"] + 2  # with the running row's token
        for future, prompt in ((first, QUESTIONS[0]), (late, QUESTIONS[1])):
            ids = engine.encode(prompt)
            expected = reference_greedy(reference, ids, 8, tokenizer.eos_token_id)
            assert future.result(timeout=60).token_ids == expected
    finally:
        engine.close()
