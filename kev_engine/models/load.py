"""Checkpoints into Kev's model: a safetensors folder or a GGUF file read straight into Kev's
layout, or the tensors of a transformers model already in memory.

Where this sits: `Engine.from_pretrained` reads a folder here (no transformers model is built on
Kev's path: the config and generation config are read from their JSON, the tensors one at a time
from the safetensors files); `Engine(model, tokenizer)` with a transformers model of a family Kev
owns takes its tensors (`from_module`). A family Kev does not own runs on the transformers model
itself (`models.choose_impl`). A GGUF's quantized weights stay as the file stores them where the
engine computes them in place (`from_gguf`, `gguf_file`), else they are dequantized.
"""

from __future__ import annotations

import json
import logging
import struct
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


def from_gguf(path: str | Path, config: Any, generation: Any, dtype: torch.dtype, device: torch.device,
              keep_quantized: bool) -> DecoderModel:
    """Kev's model from a .gguf (`config` and `generation` read from its header): quantized weights
    as stored where `keep_quantized`, everything else dequantized into `dtype`, one tensor at a time."""
    from .gguf_file import GgufFile

    started = time.perf_counter()
    tensors = GgufFile(path, config, keep_quantized)
    model = DecoderModel(config.model_type, config, tensors.get, dtype, device, generation)
    kept = ", ".join(f"{count} {kind}" for kind, count in sorted(tensors.kept.items()))
    log.info("Kev: read %s in %.1f s; weights as stored: %s", Path(path).name, time.perf_counter() - started,
             kept or "none")
    if tensors.dequantized:
        log.info("Kev: %s: dequantized into %s (types Kev does not compute in place): %s", Path(path).name,
                 str(dtype).removeprefix("torch."),
                 ", ".join(f"{count} {kind}" for kind, count in sorted(tensors.dequantized.items())))
    model.weights = f"as stored ({kept})" if kept else "dense"
    return model


def dense_bytes(path: str | Path, dtype: torch.dtype) -> int:
    """The bytes a GGUF's tensors take dequantized into `dtype` (from its header alone)."""
    from .gguf_file import read_header

    _, tensors = read_header(Path(path))
    return sum(info.numel for info in tensors.values()) * torch.tensor([], dtype=dtype).element_size()


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


class SafetensorsFolder:
    """The tensors of a folder's safetensors files by name (`model.safetensors`, or the shards an
    index names), each read from its file into memory of its own when asked for.

    Read, not mapped: a mapped file's pages stay resident while the mapping lives, so a model
    read through a mapping holds its file's size in memory beside the weights Kev keeps (and
    the platform's packed copies made from them). Here only the tensors asked for exist."""

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model folder {str(folder)!r} has no .safetensors files")
        self._files = [open(folder / file, "rb") for file in files]  # noqa: SIM115 - closed by __exit__
        self._where: dict[str, tuple[Any, int, dict[str, Any]]] = {}
        for stream in self._files:
            size = struct.unpack("<Q", stream.read(8))[0]
            header = json.loads(stream.read(size))
            header.pop("__metadata__", None)
            for key, entry in header.items():
                self._where[key] = (stream, 8 + size, entry)

    def names(self) -> list[str]:
        """Every tensor's name."""
        return list(self._where)

    def get(self, name: str) -> torch.Tensor | None:
        found = self._where.get(name)
        if found is None:
            return None
        stream, base, entry = found
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name} is stored as {entry['dtype']}; Kev reads {sorted(SAFETENSORS_DTYPES)}")
        start, end = entry["data_offsets"]
        tensor = torch.empty(entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]])
        if tensor.nbytes != end - start:
            raise ValueError(f"{name}: {end - start} bytes in the file for a {entry['dtype']} tensor of shape "
                             f"{entry['shape']}; the file is damaged")
        stream.seek(base + start)
        if tensor.nbytes and stream.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != tensor.nbytes:
            raise ValueError(f"{name}: the file ends before its data; the file is damaged")
        return tensor

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in self._files:
            stream.close()
        self._where.clear()
