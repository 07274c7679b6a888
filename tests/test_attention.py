"""The attention paths themselves: per-segment SDPA, and the flash-attn varlen plumbing.

flash-attn needs CUDA, which CI does not have; its call is checked here against a pure-torch
implementation of `flash_attn_varlen_func`'s contract (cu_seqlens, bottom-right causal), so the
packing, cache gathering and layout logic of the CUDA path run on every CI machine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import QUESTIONS, reference_copy, tiny_model

from kev_engine import Engine, SamplingParams, attention
from kev_engine.pack import Segment, pack


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
    """flash_attn_varlen_func's contract in plain torch: q [Tq, H, D], k/v [Tk, kvH, D]."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, ks = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1), k[cu_k[i]:cu_k[i + 1]].transpose(0, 1)
        vs = v[cu_k[i]:cu_k[i + 1]].transpose(0, 1)
        n, m = qs.shape[1], ks.shape[1]
        mask = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n) if causal else None
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, scale=softmax_scale,
                                           enable_gqa=True)
        out[cu_q[i]:cu_q[i + 1]] = o[0].transpose(0, 1)
    assert max_q == max(int(cu_q[i + 1] - cu_q[i]) for i in range(len(cu_q) - 1))
    return out


def test_flash_varlen_path_matches_solo(tokenizer, monkeypatch) -> None:
    model = tiny_model("llama", tokenizer)
    reference = reference_copy(model)
    monkeypatch.setattr(attention, "_flash_attn_varlen_func", varlen_reference)
    monkeypatch.setattr(attention, "use_flash", lambda query: True)
    # a small budget chunks the prefill: new chunks attend to cached prefixes
    engine = Engine(model, tokenizer, max_batch_tokens=40, max_num_seqs=8)
    results = engine.generate(QUESTIONS, SamplingParams(temperature=0, max_tokens=6))
    for prompt, result in zip(QUESTIONS, results):
        ids = torch.tensor([engine.encode(prompt)])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        assert result.token_ids == expected[0, ids.shape[1]:].tolist()
    engine.close()


def test_no_dense_mask_reaches_the_attention(tokenizer, monkeypatch) -> None:
    """transformers must hand Kev's attention no mask at all (no T×T tensor is ever built)."""
    seen = []
    original = attention.kev_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(attention.AttentionInterface._global_mapping, attention.KEV_ATTENTION, spy)
    engine = Engine(tiny_model("qwen3", tokenizer), tokenizer)
    engine.prompt_logits(QUESTIONS)
    assert seen and all(mask is None for mask in seen)


def test_segment_attention_with_prefix_is_bottom_right_causal() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 3, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 8)  # 3 new queries over 4 cached
    out = attention._segment_attention(q, k, v, past_len=4, scaling=None)
    full_q = torch.cat([torch.randn(4, 4, 8), q], dim=1)
    expected = F.scaled_dot_product_attention(full_q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0, :, 4:]
    torch.testing.assert_close(out, expected)


def test_model_used_outside_the_engine_fails_loudly(tokenizer) -> None:
    model = tiny_model("llama", tokenizer)
    Engine(model, tokenizer)
    try:
        model(input_ids=torch.tensor([[1, 2, 3]]))
    except RuntimeError as exc:
        assert "kev_engine.Engine" in str(exc)
    else:
        raise AssertionError("a Kev-owned model must not silently run unpacked attention")


def test_pack_round_trip() -> None:
    segments = [Segment(0, [5, 6, 7], 0, True), Segment(1, [9], 4, True), Segment(2, [1, 2], 0, False)]
    batch = pack(segments)
    assert batch.input_ids.tolist() == [5, 6, 7, 9, 1, 2]
    assert batch.position_ids.tolist() == [0, 1, 2, 4, 0, 1]  # restart per question; decode continues its own
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6] and batch.max_seqlen == 3
    assert batch.logits_indices.tolist() == [2, 3]  # only segments that sample
    assert batch.segment_lengths() == [3, 1, 2] and batch.past_lens == [0, 4, 0]
