"""First step of the flow: one prompt → the exact token ids the engine feeds.

Each question is tokenized on its own, with its own chat template and special tokens, so no
segment of a pack is shifted by a neighbour. Template output is tokenized with
`add_special_tokens=False`: the template already wrote any BOS (a double BOS otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InvalidRequestError

Message = Mapping[str, Any]
Prompt = str | Sequence[Message] | Mapping[str, Any]


def _check_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    if len(messages) == 0:
        raise InvalidRequestError("prompt=[] is empty; give a non-empty string or at least one chat message")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise InvalidRequestError(
                f"message {i} = {message!r} is not a chat message; use a dict with 'role' and 'content'"
            )
        if not isinstance(message["role"], str) or not message["role"]:
            raise InvalidRequestError(f"message {i} has role={message['role']!r}; use a non-empty string")
        if not isinstance(message["content"], str) and message["content"] is not None:
            raise InvalidRequestError(
                f"message {i} has content of type {type(message['content']).__name__}; use a string"
            )
        checked.append(dict(message))
    if not any((m["content"] or "").strip() for m in checked):
        raise InvalidRequestError("every chat message is empty; give at least one with content")
    return checked


def render_prompt(tokenizer: Any, prompt: Any) -> tuple[str, bool]:
    """Return the text to tokenize and whether the tokenizer should add its special tokens.

    A prompt is raw text, a list of chat messages, or ``{"messages": [...], "tools": [...]}``
    (tool schemas handed to the model's own chat template).
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidRequestError(f"prompt={prompt!r} is empty; give some text")
        return prompt, True
    tools = None
    if isinstance(prompt, Mapping):
        unknown = sorted(set(prompt) - {"messages", "tools"})
        if unknown or "messages" not in prompt:
            raise InvalidRequestError(
                f"a dict prompt takes 'messages' (required) and 'tools'; got keys {sorted(prompt)}"
            )
        prompt, tools = prompt["messages"], prompt.get("tools") or None
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        messages = _check_messages(prompt)
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "chat messages need a chat template and this tokenizer has none; pass the prompt as a string"
            )
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return text, False
    raise InvalidRequestError(
        f"prompt of type {type(prompt).__name__} is not allowed; use a string or a list of chat messages"
    )


def encode_prompt(tokenizer: Any, prompt: Any, max_context: int) -> list[int]:
    """Tokenize one prompt; refuse it when it leaves no room for one new token."""
    text, add_special = render_prompt(tokenizer, prompt)
    ids: list[int] = tokenizer(text, add_special_tokens=add_special)["input_ids"]
    if len(ids) == 0:
        raise InvalidRequestError(f"prompt={text[:60]!r} tokenizes to nothing; give some text")
    if len(ids) >= max_context:
        raise InvalidRequestError(
            f"prompt is {len(ids)} tokens; the model's context is {max_context} tokens, "
            f"so a prompt may have at most {max_context - 1}"
        )
    return list(ids)
