"""What Kev's packed attention cannot compute is refused when the model loads, naming the family and
the field — never a model that loads and then fails every request — and a sliding window that the
engine's context never reaches (`max_model_len`) is no window at all."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import reference_copy, tiny_model
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from kev_engine import Engine, SamplingParams
from kev_engine.model.setup import attention_window

GREEDY = SamplingParams(temperature=0, max_tokens=6)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, pad_token_id=None,
             bos_token_id=None, tie_word_embeddings=False)


def mistral(tokenizer: Any, window: int | None) -> MistralForCausalLM:
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, sliding_window=window,
                           **SHAPE)
    return MistralForCausalLM(config).eval()


def test_a_window_narrower_than_the_context_is_refused_at_load_naming_the_way_out(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match=r"MistralForCausalLM attends within a sliding window of 64 tokens "
                                         r"\(config.sliding_window\), but its context is 1024 tokens.*"
                                         r"max_model_len=64"):
        Engine(mistral(tokenizer, 64), tokenizer)


def test_with_max_model_len_within_the_window_it_answers_as_transformers_does(
        tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    model = mistral(tokenizer, 64)
    reference = reference_copy(model)
    with caplog.at_level(logging.WARNING, logger="kev"), Engine(model, tokenizer, max_model_len=64) as engine:
        assert "keeps its own forward" not in caplog.text  # the rotary kernel's probe ran inside the window
        prompts = [engine.encode([{"role": "user", "content": q}]) for q in ("Hi.", "Name a colour.")]
        answers = engine.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        for prompt, answer in zip(prompts, answers):
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):]
            assert answer.token_ids == expected.tolist()
        with pytest.raises(Exception, match="64"):  # the context is the window: a longer prompt is refused
            engine.generate([{"prompt_token_ids": prompts[0] * 20}], GREEDY)


def test_a_window_no_shorter_than_the_context_loads(tokenizer: Any) -> None:
    with Engine(mistral(tokenizer, 4096), tokenizer) as engine:
        assert engine.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)[0].completion_tokens == 6


@pytest.mark.parametrize(("fields", "expected"), [
    ({"sliding_window": 4096}, (4096, "sliding_window")),
    ({"sliding_window": None}, None),
    ({"sliding_window": 4096, "use_sliding_window": False}, None),  # Qwen2's switch
    ({"sliding_window": 512, "layer_types": ["full_attention", "sliding_attention"]}, (512, "sliding_window")),
    ({"sliding_window": 512, "layer_types": ["full_attention", "full_attention"]}, None),
])
def test_the_window_is_read_from_whichever_field_sets_it(fields: dict[str, Any], expected: Any) -> None:
    assert attention_window(type("Config", (), fields)()) == expected


def test_qwen2_with_its_sliding_layers_is_refused(tokenizer: Any) -> None:
    model = tiny_model("qwen2", tokenizer, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM attends within a sliding window of 32"):
        Engine(model, tokenizer)
    without = tiny_model("qwen2", tokenizer, sliding_window=32)  # use_sliding_window False: no window
    Engine(without, tokenizer).close()


def test_soft_capped_attention_is_refused_naming_the_field(tokenizer: Any) -> None:
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=len(tokenizer), head_dim=16, sliding_window=4096, **SHAPE)
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM sets config.attn_logit_softcapping=50.0"):
        Engine(Gemma2ForCausalLM(config).eval(), tokenizer)


def test_kev_serve_exits_2_on_a_model_it_would_refuse(tokenizer: Any, tmp_path: Path) -> None:
    folder = tmp_path / "mistral"
    mistral(tokenizer, 64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    command = [sys.executable, "-m", "kev_integrations", "serve", "--model", str(folder), "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "KEV_API_KEY": ""})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "sliding window of 64 tokens" in done.stderr and "kev: ready" not in done.stderr
    generate = [sys.executable, "-m", "kev_integrations", "generate", "--model", str(folder), "--max-model-len", "64",
                "--max-tokens", "3", "Hi."]
    done = subprocess.run(generate, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]  # the way out the refusal names, through the CLI


def test_float16_runs_on_kevs_model_as_on_the_fallback(tokenizer: Any) -> None:
    """Kev's kernels compute float32 and bfloat16; a float16 model takes torch's ops for the rest."""
    prompts = ["Once upon a time", "The capital of France is"]
    with Engine(tiny_model("llama", tokenizer).to(torch.float16), tokenizer) as own, \
            Engine(tiny_model("llama", tokenizer).to(torch.float16), tokenizer, model_impl="transformers") as fallback:
        assert own.stats()["model_impl"] == "kev" and own.dtype == torch.float16
        short = SamplingParams(temperature=0, max_tokens=4)  # float16 rounds each its own way: a short answer
        answers = [[c.token_ids for c in engine.generate(prompts, short)] for engine in (own, fallback)]
        assert answers[0] == answers[1]


def test_attention_sinks_are_refused(tokenizer: Any) -> None:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=len(tokenizer), head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                          sliding_window=32, layer_types=["full_attention", "full_attention"], **SHAPE)
    with pytest.raises(ValueError, match=r"GptOssForCausalLM has attention sinks \(model.layers.0.self_attn.sinks\)"):
        Engine(GptOssForCausalLM(config).eval(), tokenizer)
