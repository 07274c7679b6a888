"""/v1/completions' prompt shapes, and token-id prompts as the engine takes them.

Where this sits: `protocol` reads the four shapes OpenAI and vLLM accept (a string, a list of
strings, a list of token ids, a list of such lists) with `prompt_list`; `app` then turns the
token-id ones into the engine's token prompts (``{"prompt_token_ids": ids}``) with
`engine_prompts`, before anything is queued. Ids are fed exactly as sent (lm-eval scores its own
tokens, position by position, BOS or not), once each is checked to be a token of this model: a
bad one is a 400 naming the prompt and the position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kev_engine import Engine

from .errors import bad_request

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


def engine_prompts(engine: Engine, prompts: Sequence[str | list[int]]) -> list[str | dict[str, list[int]]]:
    """Every prompt as the engine takes it: text as it is, token ids as a token prompt, each id
    checked against the vocabulary."""
    size = len(engine.tokenizer)
    out: list[str | dict[str, list[int]]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(prompt)
            continue
        where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
        for j, token in enumerate(prompt):
            if not 0 <= token < size:
                raise bad_request(f"{where}[{j}]={token} is not a token id of this model (ids 0..{size - 1})",
                                  param="prompt")
        out.append({"prompt_token_ids": prompt})
    return out


def prompt_text(engine: Engine, prompt: str | Mapping[str, Any]) -> str:
    """A prompt's text, as an echo repeats it (a token prompt: its ids decoded, special tokens kept)."""
    if isinstance(prompt, str):
        return prompt
    return str(engine.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False))
