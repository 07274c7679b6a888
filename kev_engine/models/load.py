"""Checkpoints into Kev's model: a safetensors folder read straight into Kev's layout, or the
tensors of a transformers model already in memory.

Where this sits: `Engine.from_pretrained` reads a folder here (no transformers model is built on
Kev's path: the config and generation config are read from their JSON, the tensors one at a time
from the safetensors files); `Engine(model, tokenizer)` with a transformers model of a family Kev
owns takes its tensors (`from_module`). A family Kev does not own runs on the transformers model
itself (`models.choose_impl`).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from .llama import DecoderModel

log = logging.getLogger("kev")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # config.model_type of the families Kev's forward computes
ACTIVATIONS = ("silu",)  # the MLP's activation in Kev's forward


def owned(config: Any) -> str | None:
    """Why Kev's forward cannot compute a model of this config, or None where it can."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"its family ({kind!r}) is not one of Kev's own ({', '.join(FAMILIES)})"
    act = getattr(config.get_text_config(), "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"config.hidden_act={act!r}; Kev's forward computes {', '.join(ACTIVATIONS)}"
    return None


def from_module(model: Any) -> DecoderModel:
    """Kev's model over a transformers model's tensors (its state dict: no copy where the layout is
    the same; q/k/v and gate/up fused into new tensors)."""
    state = model.state_dict()
    parameter = next(model.parameters())
    return DecoderModel(model.config.model_type, model.config, state.get, parameter.dtype, parameter.device,
                        getattr(model, "generation_config", None))


def from_folder(folder: str | Path, dtype: torch.dtype, device: torch.device, name: str | None = None) -> DecoderModel:
    """Kev's model from a transformers folder (config.json, *.safetensors), one tensor in memory at a
    time beside those already placed."""
    from transformers import AutoConfig, GenerationConfig

    folder = Path(folder)
    config = AutoConfig.from_pretrained(str(folder))
    if name is not None:
        config._name_or_path = name  # adapters compare it to their base model's
    try:
        generation = GenerationConfig.from_pretrained(str(folder))
    except OSError:  # no generation_config.json: the config's own tokens
        generation = GenerationConfig.from_model_config(config)
    started = time.perf_counter()
    with SafetensorsFolder(folder) as tensors:
        model = DecoderModel(config.model_type, config, tensors.get, dtype, device, generation)
    log.info("Kev: read %s into Kev's layout in %.1f s", folder.name, time.perf_counter() - started)
    return model


class SafetensorsFolder:
    """The tensors of a folder's safetensors files by name (`model.safetensors`, or the shards an
    index names), each read when asked for."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model folder {str(folder)!r} has no .safetensors files")
        self._handles = [safe_open(str(folder / file), framework="pt") for file in files]
        self._where = {key: handle for handle in self._handles for key in handle.keys()}

    def get(self, name: str) -> torch.Tensor | None:
        handle = self._where.get(name)
        return None if handle is None else handle.get_tensor(name)

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()
        self._where.clear()
