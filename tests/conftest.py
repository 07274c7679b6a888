"""Shared fixtures: the embedded model's tokenizer, tiny random-weight models of several
families (each paired with an independent plain-transformers copy as the reference), and the
embedded SmolLM2-135M-Instruct engine for end-to-end checks."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GlmConfig,
    GlmForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kev_engine import Engine, loader

# Passes bounded by tokens alone in the suite: how many passes a batch takes must not depend on how
# fast this machine is. The time budget has its own tests, on cost models whose numbers are given
# (test_pass_budget.py); bench_latency.py measures it on the real clock.
os.environ.setdefault("KEV_PASS_TIME_MS", "inf")

FAMILIES: dict[str, tuple[Any, Any]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "glm": (GlmConfig, GlmForCausalLM),
}
MODEL_CLASSES = {**FAMILIES, "mistral": (MistralConfig, MistralForCausalLM)}  # tiny_model's, beyond the suite's four


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `cuda` tests need a GPU: deselected, never skipped, unless the -m expression names the
    marker (`make gpu-check` runs `-m cuda`) — whatever else -m selects, `-m "not ray"` included."""
    if "cuda" in (config.getoption("markexpr") or ""):
        return
    gpu = [item for item in items if item.get_closest_marker("cuda") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("cuda") is None]


@pytest.fixture(scope="session")
def embedded_dir() -> str:
    return str(loader.converted_gguf_dir(loader.embedded_gguf()))


@pytest.fixture(scope="session")
def tokenizer(request: pytest.FixtureRequest) -> Any:
    """The embedded model's tokenizer; `KEV_TEST_MODEL_FILES` names a folder with its config and
    tokenizer files where the embedded model is not installed (`make gpu-check` carries one, made
    by `make gpu-wheels`)."""
    folder = os.environ.get("KEV_TEST_MODEL_FILES") or request.getfixturevalue("embedded_dir")
    return AutoTokenizer.from_pretrained(folder)


def tiny_model(family: str, tokenizer: Any, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random-weight model of `family` small enough for CPU tests, on the real vocabulary."""
    config_cls, model_cls = MODEL_CLASSES[family]
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,  # peaked distributions: greedy ties would make tests flaky
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    if family in ("qwen3", "glm"):
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**kwargs)).eval()


def make_adapter(base: torch.nn.Module, folder: Path, seed: int = 0, scale: float = 0.1, **config: Any) -> Path:
    """Save a PEFT LoRA adapter for `base` with random non-zero A and B (a zero B is a no-op)."""
    from peft import LoraConfig, get_peft_model

    config = config or dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(reference_copy(base), LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(folder)
    return folder


def two_adapters(base: torch.nn.Module, folder: Path, scale: float = 0.1) -> dict[str, Path]:
    """Two PEFT adapters of `base` in `folder`: "qv" on q_proj/v_proj (r=4) and "all" on every
    projection (r=8), each with random non-zero weights of its own seed."""
    return {
        "qv": make_adapter(base, folder / "qv", seed=1, scale=scale),
        "all": make_adapter(base, folder / "all", seed=2, scale=scale, r=8, lora_alpha=16, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    }


def reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent plain-transformers (sdpa) model with the same weights."""
    ref = type(model)(copy.deepcopy(model.config)).eval()
    ref.load_state_dict(model.state_dict())
    ref.set_attn_implementation("sdpa")
    return ref


# How far two correct computations of the same logits may differ when their kernels sum in
# another order (Kev's fixed order against transformers' BLAS, BLAS picking kernels by row count
# or by this CPU's vector width): a share of the largest logit's magnitude, the dtype's rounding
# carried through every layer. 2**-13 in float32 is about a thousand units in the last place
# (rounding through 30 layers has been seen at 1.9e-4 on logits of magnitude ~20, a tenth of it);
# 2**-4 in bfloat16, whose own unit in the last place is 2**-8. A question that read another's
# tokens, or one token of its context changed, moves logits by far more:
# test_isolation.py::test_the_rounding_tolerance_still_sees_one_changed_token is the control.
ROUNDING = {torch.float32: 2.0**-13, torch.bfloat16: 2.0**-4}


def rounding_tolerance(expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """The absolute tolerance for logits computed by other kernels than `expected`'s (see ROUNDING)."""
    return ROUNDING[dtype] * expected.abs().max().item()


def reference_greedy(model: torch.nn.Module, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Greedy tokens of a plain transformers `generate` on one question alone."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos,
        )
    return out[0, len(ids):].tolist()


# every family through the compiled CPU decode kernel, two through the torch decode path as well
FAMILY_PATHS = [(family, "compiled") for family in FAMILIES] + [("llama", "torch"), ("qwen3", "torch")]


@pytest.fixture(params=FAMILY_PATHS, ids=[f"{family}-{path}" for family, path in FAMILY_PATHS])
def family_pair(request: pytest.FixtureRequest, tokenizer: Any) -> tuple[Engine, torch.nn.Module]:
    """(Kev engine, reference model) of one family, same weights, decoding through one path."""
    family, path = request.param
    model = tiny_model(family, tokenizer)
    reference = reference_copy(model)
    return Engine(model, tokenizer, name=family, cpu_kernels=path), reference


@pytest.fixture
def tiny_engine(tokenizer: Any) -> Engine:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name="tiny-llama")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def embedded_engine() -> Engine:
    """The embedded model in float32 (its reference is plain transformers in float32)."""
    engine = Engine.from_pretrained(dtype="float32")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def embedded_reference(embedded_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()


def prefilled_decode_pack(engine: Engine, prompts: list[Any]) -> Any:
    """One decode row per prompt, after a prefill pass of its own wrote each prompt's KV (blocks
    handed out in order from 0, room for the new token): the pack a graph bucket replays."""
    from kev_engine.model.pack import Segment, pack

    backend, size = engine._backend, engine._kv.block_size
    segments, block = [], 0
    for i, prompt in enumerate(prompts):
        ids = engine.encode(prompt)
        blocks = list(range(block, block + -(-(len(ids) + 1) // size)))
        block = blocks[-1] + 1
        engine._runner.forward(pack([Segment(i, ids[:-1], 0, False, block_ids=blocks)], engine.device, backend), {})
        segments.append(Segment(i, ids[-1:], len(ids) - 1, True, block_ids=blocks))
    return pack(segments, engine.device, backend)


def chat(question: str, context: str | None = None) -> list[dict[str, str]]:
    content = f"Context:\n{context}\n\nQuestion: {question}" if context else question
    return [{"role": "user", "content": content}]


QUESTIONS = [
    chat("What is the capital of France?"),
    chat("Who wrote Hamlet?", "Hamlet is a tragedy written by William Shakespeare around 1600."),
    "Once upon a time",
    chat("Name a prime number."),
    chat("Why is the sky blue?", "Rayleigh scattering makes shorter wavelengths scatter more " * 4),
]


@pytest.fixture
def record_submits(engine, monkeypatch):
    """Every request the test module's `engine` fixture receives: (prompt, SamplingParams, adapter)."""
    calls: list[tuple] = []
    submit = engine.submit

    def spy(prompt, sampling=None, adapter=None, on_text=None, **options):
        calls.append((prompt, sampling, adapter))
        return submit(prompt, sampling, adapter, on_text=on_text, **options)

    monkeypatch.setattr(engine, "submit", spy)
    return calls


@pytest.fixture(scope="session")
def ray_cluster() -> Any:
    """One local Ray for the whole session (2 CPUs, no dashboard, no usage reporting), shut down at the end."""
    import os

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # it would try to reach the internet
    # Serve's router asks each replica its queue length before routing and gives up on an answer
    # after 0.1 s; on a loaded 2-core machine a replica that holds an adapter then misses the
    # deadline and the request goes to another replica, which loads the adapter too. The tests
    # check where adapter traffic lands, so they give the replicas time to answer (the workers
    # Ray starts inherit this environment).
    os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "2")
    os.environ.setdefault("RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "10")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def save_tiny_model(folder: Path, tokenizer: Any, family: str = "llama", seed: int = 0) -> Path:
    """A tiny random model and the embedded tokenizer saved as a local folder, as Ray workers load it."""
    model = tiny_model(family, tokenizer, seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
