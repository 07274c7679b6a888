"""Detokenize: a reply's text as its tokens arrive, each token decoding a bounded tail of the reply.

Where this sits: `unpack.append_token` asks it for a request's text after every token it draws
(stop strings are looked for in that text, streaming posts from it, the result carries it).

Why: decoding the whole reply at every token costs time in the reply's length, so a reply of n
tokens costs n² / 2 token decodes: a few hundred tokens in, a pass's rows take longer to decode
than to sample, every step. Where decoding is concatenation, the text of ids is the text of a
prefix plus the text of the rest, wherever the prefix's text ends on a whole character. That
holds for a byte-level BPE decoder (GPT-2's, Llama 3's, Qwen's, SmolLM's: each token stands for
fixed bytes, all the bytes are joined and read as UTF-8) with no clean-up after it: a request
keeps the text up to such a boundary (`Request.text_ids`, `text_head`), and a token decodes only
the ids after it. The boundary moves on when those are `TAIL` or more and their text does not end
in U+FFFD (a character whose bytes are still coming; a real U+FFFD only waits a token longer).
Every other tokenizer (SentencePiece's metaspace, word pieces, a clean-up pass, a slow tokenizer)
decodes the whole reply at every token, as the text is defined.

The text is the same string either way: `concatenates` checks the tokenizer's decoder and its
clean-up setting, then a probe of splits of real token ids — including split characters and
special tokens — before it trusts a tokenizer (tests/test_detokenize.py compares with the whole
decode).
"""

from __future__ import annotations

from typing import Any

from ..core.request import Request

TAIL = 16  # ids decoded at every token before the boundary moves past them
REPLACEMENT = "\ufffd"  # what a decode gives for bytes of a character not yet complete


class Detokenizer:
    """The text of a request's output ids for one tokenizer (`text`), incremental where it may be."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.incremental = concatenates(tokenizer)

    def text(self, request: Request, end: int | None = None) -> str:
        """The text of `request.output_ids[:end]` (all of them by default), special tokens left out;
        the boundary moves on only where `end` is the whole reply."""
        ids = request.output_ids
        end = len(ids) if end is None else end
        if not self.incremental or request.text_ids > end:
            return _decode(self.tokenizer, ids[:end])
        tail = _decode(self.tokenizer, ids[request.text_ids : end])
        text = request.text_head + tail
        if end == len(ids) and end - request.text_ids >= TAIL and not tail.endswith(REPLACEMENT):
            request.text_head, request.text_ids = text, end
        return text


def _decode(tokenizer: Any, ids: list[int]) -> str:
    """The text of `ids`, special tokens left out: the reply's text as it is defined."""
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def concatenates(tokenizer: Any) -> bool:
    """Whether `tokenizer` decodes ids as the concatenation of its decodes of any split of them at a
    whole character: a fast tokenizer whose decoder is byte-level BPE's alone, without the
    clean-up pass, and which decodes a probe that way (`_probe`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    try:
        from tokenizers import decoders
    except ImportError:  # pragma: no cover - transformers' fast tokenizers need it
        return False
    return isinstance(backend.decoder, decoders.ByteLevel) and _probe(tokenizer)


def _probe(tokenizer: Any) -> bool:
    """Split ids of an English, a Chinese and an emoji text (bytes of one character across tokens),
    with a special token among them, at every point: where the head's text ends on a whole
    character, head + tail must be the whole text."""
    ids: list[int] = []
    for sample in ("Kev answers, packed: one pass.", "打包的问题各自作答", "ok 🙂👍🏽 done"):
        ids += list(tokenizer.encode(sample, add_special_tokens=False))
    ids = ids[:8] + list(getattr(tokenizer, "all_special_ids", None) or [])[:1] + ids[8:]
    whole = _decode(tokenizer, ids)
    for cut in range(1, len(ids)):
        head = _decode(tokenizer, ids[:cut])
        if not head.endswith(REPLACEMENT) and head + _decode(tokenizer, ids[cut:]) != whole:
            return False
    return True
