"""Per-question LoRA adapters in one packed pass == PEFT running each question alone."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from conftest import QUESTIONS, make_adapter, reference_copy, rounding_tolerance, tiny_model
from peft import PeftModel

from kev_engine import AdapterError, Engine, SamplingParams, UnknownAdapterError

ATOL = 1e-4
ADAPTERS = {  # different ranks, targets, rslora and rank/alpha patterns
    "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "math": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["o_proj", "gate_proj", "down_proj"]),
    "pattern": dict(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj", "up_proj"],
                    rank_pattern={"k_proj": 6}, alpha_pattern={"up_proj": 32}),
}


def peft_solo(base: torch.nn.Module, folder: Path | None) -> torch.nn.Module:
    reference = reference_copy(base)
    return PeftModel.from_pretrained(reference, str(folder)).eval() if folder else reference


@pytest.fixture(params=["llama", "qwen2"])
def lora_setup(request, tokenizer, tmp_path):
    base = tiny_model(request.param, tokenizer)
    folders = {name: make_adapter(base, tmp_path / name, i, **cfg) for i, (name, cfg) in enumerate(ADAPTERS.items())}
    engine = Engine(reference_copy(base), tokenizer, max_adapters=4)
    for name, folder in folders.items():
        engine.load_adapter(name, str(folder))
    yield engine, base, folders
    engine.close()


MIX = [None, "sql", "math", "pattern", "sql"]


def test_mixed_adapters_logits_equal_peft_solo(lora_setup) -> None:
    engine, base, folders = lora_setup
    packed = engine.prompt_logits(QUESTIONS, adapters=MIX)
    assert engine.stats()["prefill_passes"] == 1
    for prompt, name, logits in zip(QUESTIONS, MIX, packed):
        reference = peft_solo(base, folders.get(name))
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([engine.encode(prompt)])).logits[0]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    base_logits = engine.prompt_logits([QUESTIONS[1]])[0]
    assert not torch.allclose(base_logits, packed[1], atol=1e-3)  # the adapter really changes the answer


def test_mixed_adapters_greedy_tokens_equal_peft_solo(lora_setup) -> None:
    engine, base, folders = lora_setup
    results = engine.generate(QUESTIONS, SamplingParams(temperature=0, max_tokens=8), adapters=MIX)
    assert engine.stats()["prefill_passes"] == 1
    for prompt, name, result in zip(QUESTIONS, MIX, results):
        ids = torch.tensor([engine.encode(prompt)])
        with torch.no_grad():
            out = peft_solo(base, folders.get(name)).generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                eos_token_id=engine.tokenizer.eos_token_id, pad_token_id=engine.tokenizer.eos_token_id)
        assert result.token_ids == out[0, ids.shape[1]:].tolist()
        assert result.adapter == name


def test_embedded_model_with_adapters_equals_peft(embedded_dir, tokenizer, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    folders = {
        "a": make_adapter(base, tmp_path / "a", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "b": make_adapter(base, tmp_path / "b", 2, r=8, lora_alpha=8, use_rslora=True, target_modules=["down_proj"]),
    }
    engine = Engine.from_pretrained(dtype="float32", adapters={k: str(v) for k, v in folders.items()})
    prompts, names = QUESTIONS[:4], ["a", None, "b", "a"]
    for prompt, name, logits in zip(prompts, names, engine.prompt_logits(prompts, adapters=names)):
        reference = peft_solo(base, folders.get(name))
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([engine.encode(prompt)])).logits[0]
        torch.testing.assert_close(logits, expected, atol=rounding_tolerance(expected, torch.float32), rtol=0)
    engine.close()


# ---- the pool ----------------------------------------------------------------------------------


@pytest.fixture
def small_pool(tokenizer, tmp_path):
    base = tiny_model("llama", tokenizer)
    folders = {n: make_adapter(base, tmp_path / n, i, r=4, lora_alpha=8, target_modules=["q_proj"])
               for i, n in enumerate("abc")}
    engine = Engine(reference_copy(base), tokenizer, max_adapters=2)
    for name, folder in folders.items():
        engine.load_adapter(name, str(folder))
    yield engine, base, folders
    engine.close()


def test_lru_eviction_moves_the_oldest_idle_adapter_out(small_pool) -> None:
    engine, _, _ = small_pool
    params = SamplingParams(max_tokens=2)
    engine.generate([QUESTIONS[0]], params, adapters=["a"])
    engine.generate([QUESTIONS[0]], params, adapters=["b"])
    engine.generate([QUESTIONS[0]], params, adapters=["a"])  # a is now the most recently used
    engine.generate([QUESTIONS[0]], params, adapters=["c"])  # evicts b, not a
    assert list(engine._adapters.resident) == ["a", "c"]
    assert engine.stats()["adapter_evictions"] == 1
    assert engine.adapters == ["a", "b", "c"]  # evicted is not forgotten
    again = engine.generate([QUESTIONS[1]], SamplingParams(max_tokens=4), adapters=["b"])[0]
    assert again.completion_tokens == 4


def test_adapter_in_use_is_never_evicted(small_pool) -> None:
    engine, base, folders = small_pool
    params = SamplingParams(temperature=0, max_tokens=6)
    solo = [engine.generate([QUESTIONS[i % 5]], params, adapters=[n])[0].token_ids for i, n in enumerate("abcab")]
    evictions_seen: list[tuple[set[str], set[str]]] = []  # (evicted, pinned at that moment)
    original_evict = engine._adapters._evict_one

    def watching_evict() -> bool:
        pinned, before = set(engine._adapters.pinned), set(engine._adapters.resident)
        evicted = original_evict()
        evictions_seen.append((before - set(engine._adapters.resident), pinned))
        return evicted

    engine._adapters._evict_one = watching_evict
    results: dict[int, list[int]] = {}
    barrier = threading.Barrier(5)

    def ask(i: int, name: str) -> None:
        barrier.wait()
        results[i] = engine.submit(QUESTIONS[i % 5], params, adapter=name).result().token_ids

    threads = [threading.Thread(target=ask, args=(i, n)) for i, n in enumerate("abcab")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(5)] == solo
    assert evictions_seen  # three adapters, two slots: slots had to change hands
    for evicted, pinned in evictions_seen:
        assert not evicted & pinned  # never an adapter an in-flight request uses


def test_hot_load_and_unload_while_requests_run(small_pool, tmp_path) -> None:
    engine, base, folders = small_pool
    long_run = engine.submit(QUESTIONS[0], SamplingParams(temperature=0, max_tokens=40), adapter="a")
    engine.unload_adapter("a")  # in use: it finishes first
    with pytest.raises(UnknownAdapterError, match=r"unknown adapter 'a'; loaded: \['b', 'c'\]"):
        engine.submit(QUESTIONS[1], adapter="a").result()
    new = make_adapter(base, tmp_path / "d", 9, r=3, lora_alpha=6, target_modules=["v_proj", "o_proj"])
    engine.load_adapter("d", str(new))
    fresh = engine.submit(QUESTIONS[2], SamplingParams(temperature=0, max_tokens=5), adapter="d").result()
    finished = long_run.result()
    assert finished.completion_tokens == 40 and fresh.completion_tokens == 5
    ids = torch.tensor([engine.encode(QUESTIONS[0])])
    with torch.no_grad():
        expected = peft_solo(base, folders["a"]).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                                          do_sample=False, eos_token_id=-1, pad_token_id=0)
    assert finished.token_ids == expected[0, ids.shape[1]:].tolist()
    assert "a" not in engine._adapters.known and engine.adapters == ["b", "c", "d"]


def test_an_adapter_unloaded_in_use_is_draining_until_its_last_request_ends(small_pool) -> None:
    engine, _, folders = small_pool
    with engine.hold():  # nothing runs: the request keeps the adapter in use
        running = engine.submit(QUESTIONS[0], SamplingParams(max_tokens=2), adapter="a")
        engine.unload_adapter("a")
        engine.unload_adapter("a")  # again while draining: still the first unload, no error
        assert engine.draining_adapters == {"a": 1} and "a" not in engine.adapters
        with pytest.raises(AdapterError, match=r"'a' is still draining: 1 request\(s\)"):
            engine.load_adapter("a", str(folders["a"]))
        assert engine.wait_for_unload("a", timeout=0) is False
    assert engine.wait_for_unload("a", timeout=60) is True  # bounded; the hold is over, so it drains
    assert running.result(60).completion_tokens == 2 and engine.draining_adapters == {}
    engine.load_adapter("a", str(folders["a"]))  # gone: the name is free again
    assert engine.wait_for_unload("b", timeout=0) is True  # not draining: nothing to wait for
    assert engine.generate([QUESTIONS[1]], SamplingParams(max_tokens=1), adapters=["a"])[0].completion_tokens == 1


def test_unknown_adapter_fails_only_its_request(small_pool) -> None:
    engine, _, _ = small_pool
    results = engine.generate(QUESTIONS[:3], SamplingParams(max_tokens=3), adapters=["a", "nope", None],
                              return_exceptions=True)
    assert isinstance(results[1], UnknownAdapterError)
    assert "unknown adapter 'nope'; loaded: ['a', 'b', 'c']" in str(results[1])
    assert results[0].completion_tokens == 3 and results[2].completion_tokens == 3


# ---- refusals at load ----------------------------------------------------------------------------


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("change, reason", [
    (dict(use_dora=True), "DoRA"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(peft_type="IA3"), "only LORA"),
])
def test_unsupported_adapter_configs_are_refused(tokenizer, tmp_path, change, reason) -> None:
    base = tiny_model("llama", tokenizer)
    folder = make_adapter(base, tmp_path / "x", 0, r=4, lora_alpha=8, target_modules=["q_proj"])
    _edit_config(folder, **change)
    engine = Engine(reference_copy(base), tokenizer)
    with pytest.raises(AdapterError, match=rf"adapter 'x'.*{reason}"):
        engine.load_adapter("x", str(folder))
    assert engine.adapters == []


def test_adapter_for_another_base_model_is_refused(tokenizer, tmp_path) -> None:
    other = tiny_model("llama", tokenizer, hidden_size=32)
    folder = make_adapter(other, tmp_path / "other", 0, r=4, lora_alpha=8, target_modules=["q_proj"])
    engine = Engine(tiny_model("llama", tokenizer), tokenizer)
    with pytest.raises(AdapterError, match=r"adapter 'other'.*another base model"):
        engine.load_adapter("other", str(folder))


def test_non_linear_targets_and_missing_files_are_refused(tokenizer, tmp_path) -> None:
    base = tiny_model("llama", tokenizer)
    folder = make_adapter(base, tmp_path / "emb", 0, r=4, lora_alpha=8, target_modules=["embed_tokens"])
    engine = Engine(reference_copy(base), tokenizer)
    with pytest.raises(AdapterError, match="adapter 'emb'.*not a LoRA A/B matrix of a linear layer"):
        engine.load_adapter("emb", str(folder))
    with pytest.raises(AdapterError, match="adapter 'missing': no such folder '.*nowhere'"):
        engine.load_adapter("missing", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.load_adapter("empty", str(tmp_path / "empty"))
    good = make_adapter(base, tmp_path / "good", 0, r=4, lora_alpha=8, target_modules=["q_proj"])
    engine.load_adapter("good", str(good))
    engine.load_adapter("good", str(good))  # the same folder again: a no-op
    with pytest.raises(AdapterError, match="already loaded from"):
        engine.load_adapter("good", str(folder))  # another folder under a taken name


def test_prompt_logits_with_more_adapters_than_slots_runs_in_turns(small_pool) -> None:
    engine, _, _ = small_pool  # max_adapters=2: the third adapter's prompt waits for a slot, then runs
    together = engine.prompt_logits(QUESTIONS[:3], adapters=["a", "b", "c"])
    alone = [engine.prompt_logits([q], adapters=[a])[0] for q, a in zip(QUESTIONS[:3], ["a", "b", "c"])]
    for packed, solo in zip(together, alone):
        torch.testing.assert_close(packed, solo, atol=ATOL, rtol=0)
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'zzz'"):
        engine.prompt_logits(QUESTIONS[:1], adapters=["zzz"])
    assert engine.prompt_logits(QUESTIONS[:2], adapters=["a", "b"])  # still serving


def test_half_precision_adapter_computes_in_fp32_like_peft(tokenizer, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    base = tiny_model("llama", tokenizer)
    folder = make_adapter(base, tmp_path / "half", 3)
    weights = folder / "adapter_model.safetensors"
    save_file({k: v.to(torch.float16) for k, v in load_file(str(weights)).items()}, str(weights))
    engine = Engine(reference_copy(base), tokenizer)
    engine.load_adapter("half", str(folder))
    assert {w.lora_A.dtype for w in engine._adapters.known["half"].modules.values()} == {torch.float32}
    packed = engine.prompt_logits(QUESTIONS[:2], adapters=["half", None])[0]
    with torch.no_grad():
        expected = peft_solo(base, folder)(input_ids=torch.tensor([engine.encode(QUESTIONS[0])])).logits[0]
    torch.testing.assert_close(packed, expected, atol=ATOL, rtol=0)


def test_a_model_left_by_a_dropped_engine_serves_a_new_engines_adapters(tokenizer, tmp_path) -> None:
    import gc

    base = tiny_model("llama", tokenizer)
    folder = make_adapter(base, tmp_path / "a", 5)
    model = reference_copy(base)
    first = Engine(model, tokenizer)
    first.load_adapter("old", str(make_adapter(base, tmp_path / "old", 6)))
    first.generate([QUESTIONS[0]], SamplingParams(max_tokens=2), adapters="old")
    del first  # never closed: its LoRA wrappers and attention are still on the model
    gc.collect()
    second = Engine(model, tokenizer)
    second.load_adapter("a", str(folder))
    logits = second.prompt_logits([QUESTIONS[1]], adapters="a")[0]
    with torch.no_grad():
        expected = peft_solo(base, folder)(input_ids=torch.tensor([second.encode(QUESTIONS[1])])).logits[0]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    second.close()
    assert model.config._attn_implementation == "sdpa"  # given back as it first came
