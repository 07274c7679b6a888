"""PEFT adapter folders: read, validated, refused with the reason — never guessed.

Everything about an adapter (rank, alpha, rslora, rank/alpha patterns, targets) comes from
its `adapter_config.json` and weights, never from the caller; what the packed path cannot compute
exactly like PEFT — and any unreadable file, bad config value or non-finite weight — is
refused at load as an `AdapterError` naming the adapter, its folder and the reason.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import AdapterError
from .lora import LoraAdapter, LoraWeights, MultiLoRALinear

log = logging.getLogger("kev")
PEFT_PREFIX = "base_model.model."
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (use_dora=True)",
    "lora_bias": "LoRA bias terms (lora_bias=True)",
    "layer_replication": "layer replication",
    "use_qalora": "QALoRA",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
}
# not part of a model's name: Kev's converted-GGUF cache key ("-<16 hex>", formerly "-<size>-<mtime>"),
# then a GGUF file name's quantization tag ("SmolLM2-135M-Instruct.Q4_1")
_CACHE_KEY = re.compile(r"-([0-9a-f]{16}|\d+-\d+)$")
_QUANT_TAG = re.compile(r"[.\-_](i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def _pattern_value(patterns: dict[str, Any], module_name: str, default: Any) -> Any:
    """PEFT's rank_pattern/alpha_pattern rule: the first key matching the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    if not folder.exists():
        raise AdapterError(f"adapter {name!r}: no such folder {str(folder)!r}")
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {str(folder)!r} is a file; give the PEFT adapter's folder")
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: no adapter_config.json in {str(folder)!r}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter {name!r}: cannot read {str(config_file)!r}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {str(config_file)!r} holds a {type(config).__name__}, not a JSON object")
    return config


def _check_rank(name: str, config_file: str, key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise AdapterError(f"adapter {name!r}: {key}={value!r} in {config_file!r}; use an integer >= 1")
    return value


def _check_alpha(name: str, config_file: str, key: str, value: Any) -> float:
    # json.loads reads NaN and Infinity; either would turn every answer into token 0
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise AdapterError(f"adapter {name!r}: {key}={value!r} in {config_file!r}; use a finite number")
    return float(value)


def _read_weights(name: str, folder: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors; a missing, truncated or foreign file is an AdapterError naming it."""
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        weights_file = folder / "adapter_model.bin"
    if not weights_file.is_file():
        raise AdapterError(f"adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {str(folder)!r}")
    try:
        if weights_file.suffix == ".safetensors":
            from safetensors.torch import load_file

            weights = load_file(str(weights_file))
        else:
            weights = torch.load(str(weights_file), map_location="cpu", weights_only=True)
    except Exception as exc:  # safetensors, pickle and zip each raise their own kinds for a damaged file
        raise AdapterError(
            f"adapter {name!r}: cannot read {str(weights_file)!r} ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise AdapterError(f"adapter {name!r}: {str(weights_file)!r} is not a mapping of names to tensors")
    return weights


def _leaf_name(name_or_path: str) -> str:
    """'HuggingFaceTB/SmolLM2-135M-Instruct', '/x/SmolLM2-135M-Instruct.Q4_1.gguf' and Kev's converted
    '~/.cache/kev/SmolLM2-135M-Instruct.Q4_1-75d583c6e691fabe' → 'smollm2-135m-instruct'."""
    leaf = name_or_path.replace("\\", "/").rstrip("/").rpartition("/")[2].casefold().removesuffix(".gguf")
    return _QUANT_TAG.sub("", _CACHE_KEY.sub("", leaf))


def _warn_if_other_base(name: str, config: dict[str, Any], model: nn.Module) -> None:
    """A different `base_model_name_or_path` only warns: fine-tunes and local copies rename models freely."""
    wanted = config.get("base_model_name_or_path")
    have = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not isinstance(wanted, str) or not isinstance(have, str) or not _leaf_name(wanted) or not _leaf_name(have):
        return  # an unnamed side (a model built in memory, an adapter saved without it): nothing to compare
    if _leaf_name(wanted) != _leaf_name(have):
        log.warning(
            "Kev: adapter %r was trained on %r but the engine's model is %r; its shapes match, so it loads, "
            "but its answers may be poor",
            name, wanted, have,
        )


def _target_shape(name: str, model: Any, module_name: str) -> tuple[int, int]:
    """(in_features, out_features) of the projection an adapter targets: a part of Kev's own model
    (q/k/v/o/gate/up/down, by PEFT's module name), or a Linear of a transformers model."""
    if not isinstance(model, nn.Module):
        shape = model.lora_target(module_name)
        if shape is None:
            raise AdapterError(f"adapter {name!r} targets {module_name!r}; Kev's own model takes LoRA on the "
                               "decoder layers' q/k/v/o_proj and gate/up/down_proj (Engine(model_impl="
                               "'transformers') serves adapters on other modules)")
        return shape
    try:
        base = model.get_submodule(module_name)
    except AttributeError:
        raise AdapterError(f"adapter {name!r} targets {module_name!r}, which this base model does not have") from None
    base = base.base if isinstance(base, MultiLoRALinear) else base
    if not isinstance(base, nn.Linear):
        raise AdapterError(f"adapter {name!r} targets {module_name!r}, a {type(base).__name__}; only Linear layers")
    return base.in_features, base.out_features


def load_adapter(name: str, path: str | Path, model: Any) -> LoraAdapter:
    """Read and validate a PEFT LoRA adapter against `model`; weights stay on the CPU.

    The base-model check is by shape: an adapter whose matrices do not fit `model` is refused.
    An adapter whose `base_model_name_or_path` names another model (compared by leaf name,
    ignoring case and a GGUF quantization tag; skipped when either name is empty) but whose
    shapes fit only logs a warning on the "kev" logger.
    """
    folder = Path(path).expanduser()
    config = _read_config(name, folder)
    config_file = str(folder / "adapter_config.json")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type={config.get('peft_type')!r}; only LORA is supported")
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if config.get(flag):
            raise AdapterError(f"adapter {name!r} uses {what}, which Kev's packed LoRA path cannot compute")
    if config.get("modules_to_save"):
        raise AdapterError(
            f"adapter {name!r} has modules_to_save={config['modules_to_save']}; whole replaced modules "
            "cannot be routed per segment"
        )
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise AdapterError(f"adapter {name!r}: {config_file!r} has no {key!r}")
    rank = _check_rank(name, config_file, "r", config["r"])
    alpha = _check_alpha(name, config_file, "lora_alpha", config["lora_alpha"])
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise AdapterError(f"adapter {name!r}: rank_pattern and alpha_pattern in {config_file!r} must be objects")
    for key, value in rank_pattern.items():
        _check_rank(name, config_file, f"rank_pattern[{key!r}]", value)
    for key, value in alpha_pattern.items():
        _check_alpha(name, config_file, f"alpha_pattern[{key!r}]", value)
    rslora = bool(config.get("use_rslora"))

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_weights(name, folder).items():
        match = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight", key.removeprefix(PEFT_PREFIX))
        if match is None:
            raise AdapterError(f"adapter {name!r} has weight {key!r}, which is not a LoRA A/B matrix of a linear layer")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"adapter {name!r} in {str(folder)!r}: weight {key!r} holds NaN or inf values")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor

    modules: dict[str, LoraWeights] = {}
    for module_name, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(ab)).pop()
            raise AdapterError(f"adapter {name!r}: module {module_name!r} lacks {missing}")
        in_features, out_features = _target_shape(name, model, module_name)
        lora_A, lora_B = ab["lora_A"], ab["lora_B"]
        r = _pattern_value(rank_pattern, module_name, rank)
        if lora_A.shape != (r, in_features) or lora_B.shape != (out_features, r):
            raise AdapterError(
                f"adapter {name!r}: {module_name} has lora_A {list(lora_A.shape)} and lora_B {list(lora_B.shape)}; "
                f"this base model needs [{r}, {in_features}] and [{out_features}, {r}] "
                "(an adapter for another base model?)"
            )
        a = float(_pattern_value(alpha_pattern, module_name, alpha))  # checked finite above
        scaling = a / math.sqrt(r) if rslora else a / r
        # like PEFT's default (autocast_adapter_dtype): half-precision adapter weights compute in fp32
        if lora_A.dtype in (torch.float16, torch.bfloat16):
            lora_A, lora_B = lora_A.float(), lora_B.float()
        modules[module_name] = LoraWeights(lora_A.contiguous(), lora_B.contiguous(), scaling)
    if not modules:
        raise AdapterError(f"adapter {name!r} in {str(folder)!r} has no LoRA weights")
    _warn_if_other_base(name, config, model)  # after the shape check: only an adapter that fits gets here
    return LoraAdapter(name=name, path=str(folder), modules=modules)
