"""The engine's KV memory: shared prefixes computed once and still isolated, keys that keep
adapters and tenants apart, eviction that never touches a prefix in use, admission by memory.

Every "equal" here is against a plain transformers model (or PEFT) running the question alone.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import FAMILIES, chat, make_adapter, reference_copy, tiny_model
from peft import PeftModel

from kev_engine import Engine, InvalidRequestError, SamplingParams
from kev_engine.core.blocks import MIN_RUN, BlockManager, BlockTable, _runs_first
from kev_engine.inputs.tokenize import encode_prompt
from kev_engine.model.forward import run_model
from kev_engine.model.pack import Segment, pack
from kev_engine.platforms import torch_ops as reference
from kev_engine.platforms.torch_ops import TorchBackend

ATOL = 1e-4
DOC = ("The Harbor Museum opened in 1901. It holds 3,000 paintings, most of them seascapes, and a lighthouse "
       "lens from 1874. Its director is Mara Ilves. Admission is free on Sundays. ") * 3
DOC_QUESTIONS = [chat(q, DOC) for q in ("When did it open?", "Who is the director?", "What is free on Sundays?",
                                        "How many paintings?")]
GREEDY = SamplingParams(temperature=0, max_tokens=8)
TINY_BLOCK_BYTES = 2 * 2 * 2 * 32 * 16 * 4  # K+V, 2 layers, 2 kv heads, 32 tokens, head_dim 16, fp32


def solo_greedy(model: torch.nn.Module, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    with torch.no_grad():
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_prefix_pack_equals_solo(family, tokenizer) -> None:
    model = tiny_model(family, tokenizer)
    reference = reference_copy(model)
    engine = Engine(model, tokenizer, kv_cache_bytes=32 << 20)
    results = engine.generate(DOC_QUESTIONS, GREEDY)
    stats = engine.stats()
    assert stats["prefill_passes"] == 1
    doc_tokens = results[1].cached_tokens
    assert doc_tokens >= 128 and stats["prefix_hit_tokens"] == sum(r.cached_tokens for r in results)
    assert sum(r.cached_tokens > 0 for r in results) == len(DOC_QUESTIONS) - 1  # the first computes it once
    for prompt, result in zip(DOC_QUESTIONS, results):
        assert result.token_ids == solo_greedy(reference, engine.encode(prompt), 8, tokenizer.eos_token_id)
    engine.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_prefix_logits_equal_plain_forward(family, tokenizer) -> None:
    """Question B starts after the document blocks that question A writes in the same pass."""
    model = tiny_model(family, tokenizer)
    reference = reference_copy(model)
    Engine(model, tokenizer, model_impl="transformers")  # switches the model to Kev's attention
    a_ids, b_ids = (encode_prompt(tokenizer, p, 1024) for p in DOC_QUESTIONS[:2])
    backend = TorchBackend()
    kv = backend.allocate(model, torch.device("cpu"), torch.float32, kv_cache_bytes=8 << 20, block_size=16)
    blocks = BlockManager(kv.num_blocks, kv.block_size)
    a_table, b_table = BlockTable(), BlockTable()
    assert blocks.allocate(a_table, a_ids, None) == 0
    blocks.announce(a_table, a_ids, None, len(a_ids))
    shared = blocks.allocate(b_table, b_ids, None)
    assert shared and shared % 16 == 0 and a_table.block_ids[: shared // 16] == b_table.block_ids[: shared // 16]
    batch = pack([Segment(0, a_ids, 0, False, block_ids=a_table.block_ids, all_logits=True),
                  Segment(1, b_ids[shared:], shared, False, block_ids=b_table.block_ids, all_logits=True)],
                 backend=backend)
    logits = run_model(model, batch, backend)
    with torch.no_grad():
        expected_a = reference(input_ids=torch.tensor([a_ids])).logits[0]
        expected_b = reference(input_ids=torch.tensor([b_ids])).logits[0, shared:]
    torch.testing.assert_close(logits[: len(a_ids)], expected_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[len(a_ids):], expected_b, atol=ATOL, rtol=0)


def test_embedded_model_shared_prefix_equals_solo(embedded_engine: Engine, embedded_reference) -> None:
    before = embedded_engine.stats()["prefix_hit_tokens"]
    results = embedded_engine.generate(DOC_QUESTIONS[:3], SamplingParams(temperature=0, max_tokens=12))
    assert embedded_engine.stats()["prefix_hit_tokens"] > before
    eos = embedded_engine.tokenizer.eos_token_id
    for prompt, result in zip(DOC_QUESTIONS, results):
        assert result.token_ids == solo_greedy(embedded_reference, embedded_engine.encode(prompt), 12, eos)
    assert "1901" in results[0].text


def test_canary_in_one_suffix_never_reaches_a_question_sharing_the_prefix(embedded_engine: Engine) -> None:
    secret = chat("Repeat the code word exactly: ZEBRA-4471.", DOC)
    probe = chat("What is the code word? Repeat it exactly.", DOC)
    blank = chat("Repeat the code word exactly: none here.", DOC)
    greedy = SamplingParams(temperature=0, max_tokens=20)
    with_secret = embedded_engine.generate([secret, probe], greedy)
    without_secret = embedded_engine.generate([blank, probe], greedy)
    assert with_secret[1].cached_tokens > 0  # the probe really read the shared document blocks
    assert "ZEBRA" in with_secret[0].text and "ZEBRA" not in with_secret[1].text
    assert with_secret[1].token_ids == without_secret[1].token_ids


def test_a_later_call_reuses_an_earlier_calls_prefix(tiny_engine: Engine) -> None:
    first = tiny_engine.generate(DOC_QUESTIONS[:1], GREEDY)[0]
    assert first.cached_tokens == 0
    later = tiny_engine.generate(DOC_QUESTIONS[1:2], GREEDY)[0]
    assert later.cached_tokens >= 128 and tiny_engine.stats()["prefix_hit_tokens"] == later.cached_tokens
    # an agent's next turn: its previous prompt AND answer are blocks already computed
    turn = [*DOC_QUESTIONS[0], {"role": "assistant", "content": first.text}, {"role": "user", "content": "Thanks!"}]
    assert tiny_engine.generate([turn], GREEDY)[0].cached_tokens >= 128


def test_different_cache_salts_never_share(tiny_engine: Engine) -> None:
    salted = [SamplingParams(temperature=0, max_tokens=4, cache_salt=s) for s in ("tenant-a", "tenant-b")]
    results = tiny_engine.generate(DOC_QUESTIONS[:2], salted)
    assert [r.cached_tokens for r in results] == [0, 0]
    again = tiny_engine.generate(DOC_QUESTIONS[2:3], salted[1])[0]
    assert again.cached_tokens > 0  # the same tenant does reuse its own prefix
    with pytest.raises(InvalidRequestError, match="cache_salt=''"):
        SamplingParams(cache_salt="")


def test_adapters_never_share_a_prefix_and_each_equals_peft(tokenizer, tmp_path) -> None:
    base = tiny_model("llama", tokenizer)
    folders = {n: make_adapter(base, tmp_path / n, seed=i, r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"])
               for i, n in enumerate(("a", "b"))}
    engine = Engine(reference_copy(base), tokenizer)
    for name, folder in folders.items():
        engine.load_adapter(name, str(folder))
    names = ["a", "b", "a", None]
    results = engine.generate(DOC_QUESTIONS, GREEDY, adapters=names)
    assert [r.cached_tokens > 0 for r in results] == [False, False, True, False]  # only the second "a" shares
    for prompt, name, result in zip(DOC_QUESTIONS, names, results):
        model = reference_copy(base)
        if name:
            model = PeftModel.from_pretrained(model, str(folders[name])).eval()
        assert result.token_ids == solo_greedy(model, engine.encode(prompt), 8, tokenizer.eos_token_id)
    engine.close()


def test_a_reloaded_adapter_does_not_reuse_old_kv(tokenizer, tmp_path) -> None:
    base = tiny_model("qwen2", tokenizer)
    old = make_adapter(base, tmp_path / "old", seed=1, r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"])
    new = make_adapter(base, tmp_path / "new", seed=2, r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"])
    engine = Engine(reference_copy(base), tokenizer)
    engine.load_adapter("style", str(old))
    engine.generate(DOC_QUESTIONS[:1], GREEDY, adapters="style")
    engine.unload_adapter("style")
    engine.load_adapter("style", str(new))  # same name, other weights
    result = engine.generate(DOC_QUESTIONS[1:2], GREEDY, adapters="style")[0]
    assert result.cached_tokens == 0
    peft = PeftModel.from_pretrained(reference_copy(base), str(new)).eval()
    assert result.token_ids == solo_greedy(peft, engine.encode(DOC_QUESTIONS[1]), 8, tokenizer.eos_token_id)
    engine.close()


def test_eviction_never_touches_a_prefix_in_use(tokenizer) -> None:
    model = tiny_model("llama", tokenizer)
    reference = reference_copy(model)
    engine = Engine(model, tokenizer, kv_cache_bytes=20 * TINY_BLOCK_BYTES, coalesce_ms=0)
    with engine.hold():
        long_one = engine.submit(DOC_QUESTIONS[0], SamplingParams(temperature=0, max_tokens=150))
        engine.step()  # the long question's prefill: its blocks are in use from here on
        held = list(engine._scheduler.running[0].blocks.block_ids)
        others = [engine.submit(chat(f"Unrelated question {i} about the number {i}."), SamplingParams(max_tokens=30))
                  for i in range(16)]
        for _ in range(400):  # the others come and go; their cached blocks are evicted for the next ones
            engine.step()
            if all(f.done() for f in others):
                break
        assert engine.stats()["kv_prefix_evictions"] > 0
        running = engine._scheduler.running
        assert len(running) == 1 and running[0].blocks.block_ids[: len(held)] == held
    assert long_one.result(timeout=120).token_ids == solo_greedy(
        reference, engine.encode(DOC_QUESTIONS[0]), 150, tokenizer.eos_token_id)
    assert all(f.result(timeout=10).completion_tokens >= 1 for f in others)
    engine.close()


def test_admission_keeps_kv_within_the_budget(tokenizer) -> None:
    budget = 1 << 19  # 32 blocks of 32 tokens on this model: one request may reach the whole context
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, kv_cache_bytes=budget, max_num_seqs=64,
                    coalesce_ms=0)
    prompts = [chat(f"Write a long story number {i}.") for i in range(500)]
    with engine.hold():
        futures = [engine.submit(p, SamplingParams(max_tokens=4096 - 64)) for p in prompts]
        for _ in range(20):
            engine.step()
            stats = engine.stats()
            assert stats["kv_cache_bytes"] <= stats["kv_cache_budget_bytes"] <= budget
        assert 0 < stats["running"] <= 32 and stats["waiting"] > 400  # admitted by memory, not by count
        for future in futures:
            future.cancel()
    assert engine.stats()["kv_cache_peak_bytes"] <= budget
    engine.close()


def test_preempted_requests_still_answer_as_solo(tokenizer) -> None:
    model = tiny_model("qwen3", tokenizer)
    reference = reference_copy(model)
    engine = Engine(model, tokenizer, kv_cache_bytes=16 * TINY_BLOCK_BYTES, block_size=32)
    prompts = [chat(f"Tell me everything about topic {i}.") for i in range(8)]
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=60))
    assert engine.stats()["preemptions"] > 0
    for prompt, result in zip(prompts, results):
        assert result.token_ids == solo_greedy(reference, engine.encode(prompt), 60, tokenizer.eos_token_id)
    engine.close()


def test_a_request_larger_than_the_pool_is_refused_alone(tokenizer) -> None:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, kv_cache_bytes=1 << 16)
    results = engine.generate([chat("Hi."), chat("Hi.")], [SamplingParams(max_tokens=2000), {"max_tokens": 3}],
                              return_exceptions=True)
    assert isinstance(results[0], InvalidRequestError) and "kv_cache_bytes" in str(results[0])
    assert results[1].completion_tokens == 3
    engine.close()


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_stale_pool_memory_never_reaches_an_answer(tokenizer, path: str) -> None:
    """Slots past a row's length in its last block are read (and masked) by the torch decode path,
    so its pool zeroes new blocks; the kernel's pool does not, so there the NaN stays in memory
    and the kernel must never read it: NaN left in recycled memory must not turn into 0 x NaN."""
    model = tiny_model("llama", tokenizer)
    reference = reference_copy(model)
    engine = Engine(model, tokenizer, kv_cache_bytes=64 * TINY_BLOCK_BYTES, cpu_kernels=path)
    for keys, values in zip(engine._kv.keys, engine._kv.values):
        keys.fill_(float("nan"))
        values.fill_(float("nan"))
    results = engine.generate(DOC_QUESTIONS[:2], GREEDY)
    for prompt, result in zip(DOC_QUESTIONS, results):
        assert result.token_ids == solo_greedy(reference, engine.encode(prompt), 8, tokenizer.eos_token_id)
    engine.close()


def test_new_blocks_come_from_free_runs_not_from_lone_holes() -> None:
    """Lone free blocks between cached ones would scatter a pass's blocks over the pool."""
    manager = BlockManager(num_blocks=40, block_size=4)
    tables = [BlockTable() for _ in range(10)]
    for i, table in enumerate(tables):  # ids 0..19, two per request
        manager.allocate(table, list(range(100 * i, 100 * i + 8)), extra=None)
    for table in tables[::2]:  # never committed, so nothing is cached: ids 0-1, 4-5, ... are free again
        manager.free(table)
    new = BlockTable()
    manager.allocate(new, list(range(1000, 1012)), extra=None)
    assert new.block_ids == [20, 21, 22]  # the run 20..39, not the holes 0, 1, 4
    assert manager.grow(new, 16) and new.block_ids[-1] == 23
    rest = BlockTable()
    manager.allocate(rest, list(range(2000, 2000 + 4 * (40 - 24 - MIN_RUN + 1))), extra=None)
    assert rest.block_ids == list(range(24, 24 + 40 - 24 - MIN_RUN + 1))  # what is left above 32 is too short
    last = BlockTable()
    manager.allocate(last, list(range(3000, 3008)), extra=None)
    assert last.block_ids == [0, 1]  # no run is left: the lowest lone blocks


def test_free_run_search_equals_a_plain_scan() -> None:
    """The allocator finds runs by bisection; a plain scan over random free lists must agree."""
    def scan(free: list[int], count: int) -> list[int]:
        picked, start = [], 0
        while start < len(free):
            end = start + 1
            while end < len(free) and free[end] == free[end - 1] + 1:
                end += 1
            if end - start >= MIN_RUN and len(picked) < count:
                picked.extend(range(start, min(end, start + count - len(picked))))
            start = end
        return picked + [k for k in range(len(free)) if k not in set(picked)][: count - len(picked)]

    rng = random.Random(0)
    for _ in range(500):
        free = sorted(rng.sample(range(120), rng.randint(1, 80)))
        count = rng.randint(1, len(free))
        assert _runs_first(free, count) == scan(free, count), (free, count)


def test_a_fragmented_pool_is_still_read_in_place(tokenizer) -> None:
    """After calls whose cached prefixes sit between freed tails, the next batch's decode reads
    its blocks as dense ranges of the pool, with no copy (the torch decode path's grouping; the
    compiled kernel follows block tables and never copies)."""
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, cpu_kernels="torch")
    prompts = [chat(f"Question {i}: " + "tell me about the harbor museum and its lighthouse lens. " * (1 + i % 4))
               for i in range(12)]
    for salt in ("a", "b", "c"):
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, cache_salt=salt))
    layouts = []
    original = reference.decode_layout

    def recorded(segments, *args, **kwargs):
        layout = original(segments, *args, **kwargs)
        layouts.append((segments, layout))
        return layout

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "decode_layout", recorded)
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=5, cache_salt="d"))
    engine.close()
    decodes = [(segments, layout) for segments, layout in layouts if layout is not None]
    assert decodes
    for segments, layout in decodes:
        read = {b for seg in segments if len(seg.token_ids) == 1 for b in seg.block_ids}
        assert all(g.block_ids is None for g in layout.groups)
        assert sum(g.stop - g.start for g in layout.groups) <= len(read) + 2
