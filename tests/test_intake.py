"""Inputs a caller can get wrong fail early, alone and by name (intake: params, adapters, loader, tokenize).

Out-of-range sampling settings, near-zero temperatures, damaged or non-finite adapter files,
missing model paths, malformed prompts: each is refused with an error naming the bad value
(or answered sensibly) before it can reach — and fail — a shared forward pass.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from conftest import QUESTIONS, make_adapter, reference_copy, tiny_model

from kev_engine import AdapterError, Engine, InvalidRequestError, SamplingParams, loader
from kev_engine.inputs.tokenize import check_prompt_list
from kev_engine.sample.sample import sample

# ---- params: seed and top_k must fit what torch takes --------------------------------------------


@pytest.mark.parametrize("kwargs, named", [
    (dict(seed=2**64), "seed=18446744073709551616"),
    (dict(seed=-(2**63) - 1), "seed=-9223372036854775809"),
    (dict(top_k=2**63), "top_k=9223372036854775808"),
])
def test_out_of_range_seed_and_top_k_are_refused_up_front(kwargs, named) -> None:
    with pytest.raises(InvalidRequestError, match=named) as caught:
        SamplingParams(**kwargs)
    assert "2**6" in str(caught.value)  # the allowed range is named too


def test_an_out_of_range_seed_fails_alone_and_the_edges_run(tiny_engine: Engine) -> None:
    settings = [{"temperature": 1.0, "seed": 2**64, "max_tokens": 2},
                {"temperature": 1.0, "seed": 2**64 - 1, "max_tokens": 2},
                {"temperature": 1.0, "seed": -(2**63), "top_k": 2**63 - 1, "max_tokens": 2}]
    results = tiny_engine.generate(QUESTIONS[:3], settings, return_exceptions=True)
    assert isinstance(results[0], InvalidRequestError) and "seed=" in str(results[0])
    assert [r.completion_tokens for r in results[1:]] == [2, 2]  # the extreme allowed values sample fine


# ---- sample: a tiny temperature is greedy; no row ever draws from NaN ----------------------------


def test_a_tiny_temperature_gives_the_greedy_tokens(tiny_engine: Engine) -> None:
    greedy, tiny = tiny_engine.generate(
        [QUESTIONS[0], QUESTIONS[0]],
        [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=1e-40, max_tokens=8, seed=1)],
    )
    assert tiny.token_ids == greedy.token_ids


def test_sample_never_draws_from_non_finite_probabilities() -> None:
    logits = torch.randn(4, 32)  # [N, V]
    logits[1, 5] = float("inf")  # a model gone wrong: softmax of this row is all NaN
    logits[2, 7] = 1e38  # finite, but / 0.01 overflows
    logits[3] = torch.arange(32.0)
    temperature = torch.tensor([1e-40, 0.7, 0.01, 1e-6])
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    tokens = sample(logits, temperature, torch.ones(4), torch.zeros(4, dtype=torch.long), generators)
    assert tokens.tolist() == [int(logits[0].argmax()), 5, 7, 31]


# ---- adapters: files that are damaged or non-finite ----------------------------------------------


@pytest.fixture
def adapter_folder(tokenizer, tmp_path) -> tuple[Engine, Path]:
    base = tiny_model("llama", tokenizer)
    folder = make_adapter(base, tmp_path / "adapter", 0, r=4, lora_alpha=8, target_modules=["q_proj"])
    engine = Engine(reference_copy(base), tokenizer)
    yield engine, folder
    engine.close()


def _config(folder: Path) -> dict:
    return json.loads((folder / "adapter_config.json").read_text())


def _write_config(folder: Path, config: dict) -> None:
    (folder / "adapter_config.json").write_text(json.dumps(config))  # json writes NaN / Infinity as such


def _refused(engine: Engine, folder: Path, reason: str) -> str:
    with pytest.raises(AdapterError, match=reason) as caught:
        engine.load_adapter("bad", str(folder))
    message = str(caught.value)
    assert "'bad'" in message and str(folder) in message  # names the adapter and where it lives
    assert engine.adapters == []
    return message


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_lora_alpha_is_refused(adapter_folder, alpha) -> None:
    engine, folder = adapter_folder
    _write_config(folder, {**_config(folder), "lora_alpha": alpha})
    _refused(engine, folder, "lora_alpha=")


def test_non_finite_alpha_pattern_is_refused(adapter_folder) -> None:
    engine, folder = adapter_folder
    _write_config(folder, {**_config(folder), "alpha_pattern": {"q_proj": float("nan")}})
    _refused(engine, folder, "alpha_pattern")


def test_non_finite_weights_are_refused(adapter_folder) -> None:
    from safetensors.torch import load_file, save_file

    engine, folder = adapter_folder
    weights_file = folder / "adapter_model.safetensors"
    weights = load_file(str(weights_file))
    key = sorted(weights)[0]
    weights[key][0, 0] = float("nan")
    save_file(weights, str(weights_file))
    _refused(engine, folder, "NaN or inf")


def test_truncated_weights_are_refused(adapter_folder) -> None:
    engine, folder = adapter_folder
    weights_file = folder / "adapter_model.safetensors"
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[: len(data) // 2])
    assert str(weights_file) in _refused(engine, folder, "cannot read")


def test_missing_weights_are_refused(adapter_folder) -> None:
    engine, folder = adapter_folder
    (folder / "adapter_model.safetensors").unlink()
    _refused(engine, folder, "no adapter_model.safetensors or adapter_model.bin")


@pytest.mark.parametrize("edit, reason", [
    (lambda c: {k: v for k, v in c.items() if k != "r"}, "has no 'r'"),
    (lambda c: {k: v for k, v in c.items() if k != "lora_alpha"}, "has no 'lora_alpha'"),
    (lambda c: {**c, "r": "four"}, "r='four'"),
    (lambda c: {**c, "r": 0}, "r=0"),
    (lambda c: {**c, "rank_pattern": {"q_proj": 2.5}}, "rank_pattern"),
    (lambda c: ["not", "an", "object"], "not a JSON object"),
])
def test_bad_config_values_are_refused(adapter_folder, edit, reason) -> None:
    engine, folder = adapter_folder
    _write_config(folder, edit(_config(folder)))
    _refused(engine, folder, reason)


def test_invalid_config_json_is_refused(adapter_folder) -> None:
    engine, folder = adapter_folder
    (folder / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8,')
    _refused(engine, folder, "cannot read")


# ---- adapters: another base model's name only warns when the shapes fit --------------------------


@pytest.mark.parametrize("adapter_base, engine_model, warns", [
    ("someone/Other-Model-7B", "HuggingFaceTB/SmolLM2-135M-Instruct", True),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "/models/smollm2-135m-instruct", False),  # leaf, any case
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1", False),  # a GGUF's quant tag
    ("/home/u/.cache/kev/SmolLM2-135M-Instruct.Q4_1-75d583c6e691fabe", "SmolLM2-135M-Instruct", False),
    ("/home/u/.cache/kev/SmolLM2-135M-Instruct.Q4_1-98362432-1796035716", "SmolLM2-135M-Instruct", False),
    (None, "HuggingFaceTB/SmolLM2-135M-Instruct", False),  # unnamed: nothing to compare
    ("someone/Other-Model-7B", "", False),
])
def test_another_base_model_name_warns_but_loads(adapter_folder, caplog, adapter_base, engine_model, warns) -> None:
    engine, folder = adapter_folder
    _write_config(folder, {**_config(folder), "base_model_name_or_path": adapter_base})
    engine.model.config._name_or_path = engine_model
    with caplog.at_level(logging.WARNING, logger="kev"):
        engine.load_adapter("named", str(folder))
    assert engine.adapters == ["named"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "kev" and "trained on" in r.getMessage()]
    if warns:
        assert len(warnings) == 1 and "'named'" in warnings[0]
        assert adapter_base in warnings[0] and engine_model in warnings[0]
    else:
        assert warnings == []


# ---- loader: a missing model path fails at once; a hub id never waits on an unreachable hub ------


@pytest.mark.parametrize("source", [
    "/no/such/kev-model", "./no-such-kev-model", "../no-such-kev-model", "~/no-such-kev-model",
    "no/such/kev-model", "no-such-kev-model",
])
def test_a_missing_model_path_is_file_not_found(source) -> None:
    with pytest.raises(FileNotFoundError, match=f"model folder '{source}' does not exist"):
        loader.load(source, device="cpu")


def test_owner_name_under_an_existing_folder_is_a_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="'models/missing' does not exist"):
        loader.load("models/missing", device="cpu")


def test_a_folder_without_a_model_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        loader.load(str(tmp_path), device="cpu")


def _no_network(*args, **kwargs):
    raise AssertionError("the hub was asked although HF_HUB_OFFLINE is set")


def test_a_hub_id_offline_fails_with_a_clear_error(tmp_path, monkeypatch) -> None:
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub, "model_info", _no_network)
    assert loader.is_hub_id("kev-tests/no-such-model")
    with pytest.raises(OSError, match="'kev-tests/no-such-model' is not a local folder and not in the local "
                                      "Hugging Face cache, and HF_HUB_OFFLINE is set"):
        loader.load("kev-tests/no-such-model", device="cpu")


def test_a_hub_id_with_the_hub_unreachable_fails_with_a_clear_error(tmp_path, monkeypatch) -> None:
    import huggingface_hub

    def unreachable(*args, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    with pytest.raises(OSError, match="not in the local Hugging Face cache, and the Hugging Face hub could not "
                                      "be reached"):
        loader.load("kev-tests/no-such-model", device="cpu")


# ---- tokenize: bad text, None content, templates that fail, the wrong nesting --------------------


def test_a_lone_surrogate_is_refused_naming_its_position(tiny_engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="'\\\\ud800' at position 1"):
        tiny_engine.encode("a\ud800")
    with pytest.raises(InvalidRequestError, match="message 1's content .* position 2"):
        tiny_engine.encode([{"role": "system", "content": "hi"}, {"role": "user", "content": "ab\udfff"}])


def test_bad_text_fails_alone_in_generate(tiny_engine: Engine) -> None:
    prompts = ["a\ud800", QUESTIONS[0], [{"role": "user", "content": "x\ud800"}]]
    results = tiny_engine.generate(prompts, SamplingParams(max_tokens=2), return_exceptions=True)
    assert isinstance(results[0], InvalidRequestError) and isinstance(results[2], InvalidRequestError)
    assert results[1].completion_tokens == 2
    with pytest.raises(InvalidRequestError, match="not valid UTF-8"):
        tiny_engine.submit("a\ud800").result(timeout=60)


def test_none_content_renders_as_empty(tiny_engine: Engine) -> None:
    conversation = [{"role": "user", "content": "Call the tool."},
                    {"role": "assistant", "content": None},
                    {"role": "user", "content": "And now?"}]
    empty = [{**m, "content": m["content"] or ""} for m in conversation]
    assert tiny_engine.encode(conversation) == tiny_engine.encode(empty)
    [result] = tiny_engine.generate([conversation], SamplingParams(max_tokens=2))
    assert result.completion_tokens == 2


def test_a_template_error_names_the_message(tiny_engine: Engine, monkeypatch) -> None:
    template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}"
                "{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    monkeypatch.setattr(tiny_engine.tokenizer, "chat_template", template)
    bad = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    with pytest.raises(InvalidRequestError, match="cannot render message 1 \\(role 'tool'\\).*no tool turns"):
        tiny_engine.encode(bad)
    results = tiny_engine.generate([bad, "plain text"], SamplingParams(max_tokens=2), return_exceptions=True)
    assert isinstance(results[0], InvalidRequestError) and results[1].completion_tokens == 2


def test_one_chat_message_as_a_prompt_gets_a_hint(tiny_engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="one chat message.*wrap it"):
        tiny_engine.encode({"role": "user", "content": "hi"})


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("prompts, named", [
    (b"abc", "not bytes"),
    (bytearray(b"abc"), "not bytearray"),
    ("abc", "not str; wrap it"),
    ({"messages": CONVERSATION}, "not dict; wrap it"),
    (42, "not int"),
    (CONVERSATION, "got one conversation \\(a list of messages\\); wrap it: generate\\(\\[messages\\]\\)"),
])
def test_check_prompt_list_names_the_slip(prompts, named) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        check_prompt_list(prompts)


def test_check_prompt_list_passes_real_lists() -> None:
    prompts = ["text", CONVERSATION, {"messages": CONVERSATION}]
    assert check_prompt_list(prompts) == prompts
    assert check_prompt_list(tuple(prompts)) == prompts
    assert check_prompt_list([]) == []


def test_generate_names_bytes_and_one_conversation(tiny_engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="not bytes"):
        tiny_engine.generate(b"abc")
    with pytest.raises(InvalidRequestError, match="got one conversation"):
        tiny_engine.generate(CONVERSATION)
    with pytest.raises(InvalidRequestError, match="got one conversation"):
        tiny_engine.generate(CONVERSATION, return_exceptions=True)


# ---- loader: the converted-GGUF cache is keyed on content, not mtime -----------------------------


def _fake_gguf(folder: Path, size: int, fill: int = 7) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "Tiny-Model.Q4_0.gguf"
    path.write_bytes(bytes([fill]) * size)
    return path


@pytest.mark.parametrize("size", [1000, 20 << 20])  # under and over the 2 x 8 MiB hashed at the ends
def test_the_cache_key_ignores_mtime_and_location(tmp_path, size) -> None:
    gguf = _fake_gguf(tmp_path / "venv1", size)
    key = loader.gguf_cache_key(gguf)
    os.utime(gguf, (1_000_000_000, 1_000_000_000))
    assert loader.gguf_cache_key(gguf) == key
    reinstalled = _fake_gguf(tmp_path / "venv2", size)  # a fresh venv: same file, new path and mtime
    assert loader.gguf_cache_key(reinstalled) == key
    assert key.startswith("Tiny-Model.Q4_0-")


def test_the_cache_key_follows_the_content(tmp_path) -> None:
    gguf = _fake_gguf(tmp_path / "a", 4096)
    key = loader.gguf_cache_key(gguf)
    data = bytearray(gguf.read_bytes())
    data[2000] ^= 1  # same size, one byte different
    gguf.write_bytes(bytes(data))
    assert loader.gguf_cache_key(gguf) != key
    assert loader.gguf_cache_key(_fake_gguf(tmp_path / "b", 4097)) != key


def test_a_reinstalled_gguf_reuses_its_conversion(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KEV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _fake_gguf(tmp_path / "venv1", 1000)  # not a real GGUF: converting it would fail
    converted = tmp_path / "cache" / loader.gguf_cache_key(gguf)
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    (converted / ".complete").write_text(str(gguf))
    os.utime(gguf, (2_000_000_000, 2_000_000_000))
    assert loader.converted_gguf_dir(gguf) == converted
    assert loader.converted_gguf_dir(_fake_gguf(tmp_path / "venv2", 1000)) == converted
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [converted.name]  # no second conversion


def test_a_prompt_too_long_by_its_characters_is_refused_before_it_is_tokenized(tiny_engine: Engine,
                                                                                  monkeypatch) -> None:
    """Megabytes of text would hold the caller's thread (and the server's) for seconds in the
    tokenizer: past the bound set by the longest token, it is refused without that."""
    intake = tiny_engine._intake
    bound = 2 * intake.longest_token * tiny_engine.max_context
    calls: list[int] = []
    tokenizer = type(tiny_engine.tokenizer)
    original = tokenizer.__call__
    monkeypatch.setattr(tokenizer, "__call__", lambda self, text, **kw: calls.append(len(text)) or original(
        self, text, **kw))
    huge = "a" * (bound + 1)
    with pytest.raises(InvalidRequestError, match=rf"prompt is {bound + 1} characters: at least \d+ tokens, more "
                                                  r"than the model's context"):
        tiny_engine.submit(huge).result(timeout=60)
    assert calls == []  # never tokenized
    with pytest.raises(InvalidRequestError, match="tokens; the model's context is"):
        tiny_engine.encode("a " * (bound // 2))  # within the bound: tokenized, then refused by its count
    assert calls == [bound - bound % 2]
