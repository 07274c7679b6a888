"""Token counts from the engine's own tokenizer and chat template (never a downloaded GPT-2).

LangChain's default `get_num_tokens` fetches GPT-2's tokenizer from the hub (minutes of retries
offline, then a count of 0); `trim_messages(token_counter=llm)` and text splitters rely on it.
Kev counts with the model it runs.
"""

from __future__ import annotations

from typing import Any

from kev_engine import EngineLike, prompt_ids

from .remote import RemoteEngine


def text_token_ids(engine: EngineLike, text: str) -> list[int]:
    """The ids of `text` alone: no chat template, no special tokens (what text splitters count)."""
    if isinstance(engine, RemoteEngine):  # the server's tokenizer: the client has none
        return engine.text_token_ids(text)
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_token_count(engine: EngineLike, prompt: Any) -> int:
    """How many tokens the engine feeds for `prompt` (chat template, tools, special tokens), as
    `engine.encode` does but without its context-length refusal: counting is how callers find out
    that a conversation is too long. An empty conversation counts 0."""
    if isinstance(prompt, list) and not prompt:
        return 0
    if isinstance(engine, RemoteEngine):
        return len(engine.encode(prompt))
    return len(prompt_ids(engine.tokenizer, prompt)[1])
