"""A reply's text token by token (`outputs/detokenize.py`): incremental where the tokenizer's
decoding is concatenation, and always the very string the whole reply decodes to."""

from __future__ import annotations

import random
from typing import Any

import pytest
from conftest import chat
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kev_engine import Engine, SamplingParams
from kev_engine.core.request import Request
from kev_engine.outputs.detokenize import TAIL, Detokenizer, concatenates


def reply(ids: list[int] | None = None) -> Request:
    return Request(request_id=0, prompt_ids=[1], sampling=SamplingParams(), settings_version=0, max_total=10_000,
                   output_ids=list(ids or []))


def test_token_by_token_the_text_is_the_whole_decode_across_split_characters_and_special_tokens(tokenizer) -> None:
    """Random ids of the embedded vocabulary (byte tokens that split characters among them), with
    special tokens and emoji: after every token the text equals the whole decode, and the decode
    did start past a boundary (control: the incremental path ran, not the whole decode)."""
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.incremental
    rng = random.Random(7)
    specials = list(tokenizer.all_special_ids)
    emoji = tokenizer.encode("🙂👍🏽 打包", add_special_tokens=False)
    for trial in range(4):
        request = reply()
        moved = 0
        for step in range(300):
            pick = rng.random()
            token = (rng.choice(specials) if pick < 0.03 else emoji[step % len(emoji)] if pick < 0.2
                     else rng.randrange(len(tokenizer)))
            request.output_ids.append(token)
            text = detokenizer.text(request)
            assert text == tokenizer.decode(request.output_ids, skip_special_tokens=True), (trial, step)
            assert detokenizer.text(request, len(request.output_ids) - 1) == tokenizer.decode(
                request.output_ids[:-1], skip_special_tokens=True)
            moved = max(moved, request.text_ids)
        assert moved >= 300 - 2 * TAIL - 40  # the boundary kept up (a split character holds it a while)


def test_a_reply_ending_in_a_split_character_keeps_its_boundary_before_it(tokenizer) -> None:
    """The boundary never moves past ids whose text ends in a character still incomplete."""
    ids = tokenizer.encode("a" * 3 + "🙂", add_special_tokens=False)
    partial = next(cut for cut in range(1, len(ids)) if tokenizer.decode(ids[:cut]).endswith("\ufffd"))
    request = reply()
    detokenizer = Detokenizer(tokenizer)
    filler = tokenizer.encode(" word" * TAIL, add_special_tokens=False)[:TAIL]
    for token in filler + ids[:partial]:
        request.output_ids.append(token)
        detokenizer.text(request)
    assert request.text_ids == TAIL and request.text_ids < len(request.output_ids)
    for token in ids[partial:]:
        request.output_ids.append(token)
        assert detokenizer.text(request) == tokenizer.decode(request.output_ids)


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (metaspace: a word's leading space is part of its token, and
    the first is dropped): splitting its ids does not split its text."""
    vocab = {"[UNK]": 0, "▁Kev": 1, "▁packs": 2, "▁questions": 3, "▁together": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


class _Trimmed:
    """The embedded tokenizer with a decode that trims the text: a byte-level decoder, yet not concatenation."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.backend_tokenizer = inner.backend_tokenizer
        self.clean_up_tokenization_spaces = False
        self.all_special_ids = inner.all_special_ids

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        return list(self.inner.encode(text, **kwargs))

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return str(self.inner.decode(ids, **kwargs)).strip()


def test_only_a_tokenizer_whose_decoding_is_concatenation_decodes_incrementally(tokenizer) -> None:
    metaspace = _metaspace_tokenizer()
    ids = metaspace.encode("Kev packs questions together", add_special_tokens=False)
    assert metaspace.decode(ids[:2]) + metaspace.decode(ids[2:]) != metaspace.decode(ids)  # why it must not
    assert not concatenates(metaspace)
    assert not concatenates(_Trimmed(tokenizer))  # the probe catches what the decoder's type does not
    assert concatenates(tokenizer)
    request = reply(ids * 10)
    detokenizer = Detokenizer(metaspace)
    assert detokenizer.text(request) == metaspace.decode(ids * 10) and request.text_ids == 0


@pytest.mark.parametrize("where", ["past the boundary", "across it"])
def test_an_engine_reply_and_its_stop_string_are_those_of_the_whole_decode(tiny_engine: Engine, tokenizer,
                                                                            where: str) -> None:
    """A long greedy reply's text is its ids' whole decode; a stop string taken from the reply well
    after the boundary first moved (or straddling a boundary) cuts it where the whole text would."""
    prompt = chat("Tell me a long story about packing questions.")
    long = tiny_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4 * TAIL, ignore_eos=True))[0]
    assert long.text == tokenizer.decode(long.token_ids, skip_special_tokens=True)
    head = len(tokenizer.decode(long.token_ids[: 2 * TAIL + (0 if where == "across it" else 8)],
                                skip_special_tokens=True))
    start = head - 2 if where == "across it" else head
    stop = long.text[start : start + 6]
    assert len(stop) == 6 and stop.strip()
    cut = tiny_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4 * TAIL, ignore_eos=True,
                                                        stop=[stop]))[0]
    assert cut.text == long.text[: long.text.index(stop)] and cut.finish_reason == "stop"
