"""`kev quantize`: a transformers folder written as a GGUF of quantized blocks, for Kev to compute in place.

Why: people who have a Hugging Face folder (safetensors, config, tokenizer) and not a GGUF can get
the file's size in memory and a decode step that reads a third of the bytes (`weights="as-stored"`);
and tests build quantized tiny models this way, with no download.

What is written, as llama.cpp's converter writes it for the families Kev's forward owns: the
architecture ("llama" for Llama and Mistral, "qwen2", "qwen3") and the hyperparameters
transformers' GGUF reader maps back to the config; the tokenizer as a byte-level BPE ("gpt2":
tokens, their types, merges, special tokens, the chat template); every 2-D weight whose input
width is a whole number of blocks quantized by gguf-py's own quantizer (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1: the types it writes), everything else (norms, biases, a weight whose width is not) in F32.
A "llama" file's q and k rows are interleaved as llama.cpp's converter does for its rotary layout;
transformers' reader and Kev's put them back.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("kev")

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # what gguf-py quantizes
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0",
              "Q5_1": "MOSTLY_Q5_1"}


def quantize(folder: str | Path, out: str | Path, kind: str = "Q8_0") -> Path:
    """Write the model in `folder` to `out` as a GGUF whose weights are `kind` blocks; return `out`."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from ..models.load import SafetensorsFolder

    folder, out = Path(folder), Path(out)
    if kind not in TYPES:
        raise ValueError(f"type {kind!r} is not one kev quantize writes; use one of {', '.join(TYPES)}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json; give a transformers model folder")
    config = AutoConfig.from_pretrained(str(folder))
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(f"model_type {config.model_type!r} is not one kev quantize writes; it writes "
                         f"{', '.join(ARCHITECTURES)}")
    text = config.get_text_config()
    heads, kv_heads = int(text.num_attention_heads), int(text.num_key_value_heads or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    if arch == "qwen3" and head_dim != type(config)().head_dim:
        raise ValueError(f"this Qwen3 model's head_dim is {head_dim}; transformers' GGUF reader takes Qwen3's "
                         f"default ({type(config)().head_dim}), so its file would not load back")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    writer = gguf.GGUFWriter(str(out), arch)
    write_hyperparameters(writer, config, text, head_dim, kind)
    write_tokenizer(writer, folder, tokenizer, int(text.vocab_size))
    qtype = gguf.GGMLQuantizationType[kind]
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     int(text.num_hidden_layers))
    with SafetensorsFolder(folder) as tensors:
        for name in sorted(tensors.names()):
            base, _, suffix = name.rpartition(".")
            target = names.get_name(base)
            if target is None:
                raise ValueError(f"{name}: gguf-py names no GGUF tensor for it (model_type {config.model_type!r})")
            values = tensors.get(name).float().numpy()  # type: ignore[union-attr]
            if arch == "llama" and target.endswith((".attn_q", ".attn_k")):
                values = _interleave(values, heads if target.endswith(".attn_q") else kv_heads)
            if values.ndim == 2 and values.shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
                writer.add_tensor(f"{target}.{suffix}", gguf.quants.quantize(values, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(f"{target}.{suffix}", np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log.info("Kev: wrote %s (%s, %.1f MB)", out, kind, out.stat().st_size / 1e6)
    return out


def write_hyperparameters(writer: Any, config: Any, text: Any, head_dim: int, kind: str) -> None:
    import gguf

    rope = getattr(text, "rope_parameters", None) or {}
    writer.add_name(Path(str(getattr(config, "_name_or_path", "model"))).name or "model")
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[kind]])
    writer.add_block_count(int(text.num_hidden_layers))
    writer.add_context_length(int(text.max_position_embeddings))
    writer.add_embedding_length(int(text.hidden_size))
    writer.add_feed_forward_length(int(text.intermediate_size))
    writer.add_head_count(int(text.num_attention_heads))
    writer.add_head_count_kv(int(text.num_key_value_heads or text.num_attention_heads))
    writer.add_layer_norm_rms_eps(float(text.rms_norm_eps))
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(int(text.vocab_size))


def write_tokenizer(writer: Any, folder: Path, tokenizer: Any, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's converter writes a byte-level BPE one."""
    import gguf

    vocab = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in vocab:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(vocab[index])
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(vocab[index])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)


def _interleave(values: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute` of q or k rows: each head's two rotary halves interleaved."""
    return (values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:])
            .swapaxes(1, 2).reshape(values.shape))
