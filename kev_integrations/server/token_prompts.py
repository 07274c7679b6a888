"""/v1/completions' prompt shapes, and token-id prompts turned into the text the engine takes.

Where this sits: `protocol` reads the four shapes OpenAI and vLLM accept (a string, a list of
strings, a list of token ids, a list of such lists) with `prompt_list`; `app` then turns the
token-id ones into text with `prompt_texts`, on a tokenize thread, before anything is queued.

Why text: the engine takes a prompt as text (or chat messages) and tokenizes it itself, yet a
client that sends ids must be answered about exactly those ids (lm-eval scores its own tokens,
position by position). So ids become the text they decode to, kept only when the engine's own
tokenization of that text gives back the same ids. Ids no tokenizer would make of their text
(a word spelled letter by letter, a prompt without the BOS this tokenizer adds) are a 400
naming the prompt and the first position that differs, never a prompt fed as other tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kev_engine import Engine, KevError

from .errors import bad_request, engine_error

PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """The prompts of a /v1/completions body, each a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if _is_ids(prompt):  # one prompt as token ids
        return [prompt]
    if isinstance(prompt, list) and prompt:
        for i, item in enumerate(prompt):
            if not isinstance(item, str) and not _is_ids(item):
                raise bad_request(f"prompt[{i}] is {_kind(item)}; a list of prompts holds strings or non-empty "
                                  "lists of token ids (integers)", param="prompt")
        return list(prompt)
    raise bad_request(f"prompt is {_kind(prompt)}; use {PROMPT_SHAPES}", param="prompt")


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "an empty list" if not value else "a list mixing token ids with other values"
    if value is None:
        return "missing"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def prompt_texts(engine: Engine, prompts: Sequence[str | list[int]]) -> list[str]:
    """Every prompt as the text the engine feeds; a token-id prompt is checked against the
    vocabulary and must be what the engine's tokenizer makes of its decoded text (see above)."""
    tokenizer = engine.tokenizer
    added = list(tokenizer("", add_special_tokens=True)["input_ids"])  # what it puts before any text (a BOS)
    texts = []
    for i, prompt in enumerate(prompts):
        where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
        texts.append(prompt if isinstance(prompt, str) else _text_of(engine, prompt, added, where))
    return texts


def _text_of(engine: Engine, ids: list[int], added: list[int], where: str) -> str:
    size = len(engine.tokenizer)
    for j, token in enumerate(ids):
        if not 0 <= token < size:
            raise bad_request(f"{where}[{j}]={token} is not a token id of this model (ids 0..{size - 1})",
                              param="prompt")
    # the tokenizer writes its own leading special tokens: decoding them too would double them
    body = ids[len(added):] if added and ids[:len(added)] == added else ids
    text = engine.tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    try:
        fed = engine.encode(text)
    except KevError as exc:
        error = engine_error(exc, None)
        raise bad_request(f"{where} (token ids, as their text): {error.message}", param="prompt") from None
    if fed == ids:
        return text
    if fed == added + ids:
        raise bad_request(f"{where} lacks the token(s) {added} this tokenizer starts every prompt with; the "
                          "engine feeds a prompt as its text, tokenized with them: put them first", param="prompt")
    at = next((k for k, (a, b) in enumerate(zip(ids, fed)) if a != b), min(len(ids), len(fed)))
    sent = ids[at] if at < len(ids) else "nothing"
    made = fed[at] if at < len(fed) else "nothing"
    raise bad_request(f"{where}: these {len(ids)} token ids are not what this tokenizer makes of their text "
                      f"({len(fed)} ids; position {at} is {sent} here and {made} there). The engine feeds a prompt "
                      "as its text, so send ids as the tokenizer encodes them, or the text itself", param="prompt")
