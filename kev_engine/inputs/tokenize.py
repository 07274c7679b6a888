"""First step of the flow: one prompt → the exact token ids the engine feeds.

Each question is tokenized on its own, with its own chat template and special tokens, so no
segment of a pack is shifted by a neighbour. Template output is tokenized with
`add_special_tokens=False`: the template already wrote any BOS (a double BOS otherwise).

Whatever a caller can put in a prompt fails as an `InvalidRequestError` naming the spot —
text that is not valid UTF-8 (a lone surrogate), a message the chat template cannot render —
never as a tokenizer's or jinja's own exception. A message's `content=None` (an assistant
turn that only calls tools) renders as "".

A prompt may also be token ids, ``{"prompt_token_ids": [...]}`` (vLLM's `TokensPrompt` shape): fed
exactly as given — an evaluation harness scores its own tokens, position by position — once
each id is checked against the tokenizer's vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidRequestError

Message = Mapping[str, Any]
Prompt = str | Sequence[Message] | Mapping[str, Any]


def _is_message(item: Any) -> bool:
    return isinstance(item, Mapping) and "role" in item


def check_prompt_list(prompts: Any) -> list[Any]:
    """The prompts of one `generate` call as a list; refuse what is not a list of prompts.

    Catches the likely slips by name: one string, bytes, one chat conversation (a list of
    message dicts) or one dict prompt where a list of prompts belongs.
    """
    if isinstance(prompts, (str, bytes, bytearray, Mapping)) or not isinstance(prompts, Sequence):
        hint = "; wrap it: generate([prompt])" if isinstance(prompts, (str, Mapping)) else ""
        raise InvalidRequestError(
            f"prompts must be a list of prompts (strings or chat-message lists), not {type(prompts).__name__}{hint}"
        )
    prompts = list(prompts)
    if prompts and all(_is_message(item) for item in prompts):
        raise InvalidRequestError(
            "prompts must be a list of prompts, and got one conversation (a list of messages); "
            "wrap it: generate([messages])"
        )
    return prompts


def _check_text(text: str, where: str) -> None:
    """Refuse text the tokenizer cannot take: it must encode as UTF-8 (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{where} has {text[exc.start]!r} at position {exc.start}, which is not valid UTF-8 "
            "(a lone surrogate); send well-formed text"
        ) from None


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
        _check_text(message["role"], f"message {i}'s role")
        _check_text(message["content"] or "", f"message {i}'s content")
        checked.append({**message, "content": message["content"] or ""})  # None: a tool-calling turn
    if not any((m["content"] or "").strip() for m in checked):
        raise InvalidRequestError("every chat message is empty; give at least one with content")
    return checked


def _apply_template(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> str:
    """The chat template's text; a message it cannot render is named by its index."""

    def render(upto: int) -> str:
        text = tokenizer.apply_chat_template(messages[:upto], tools=tools, add_generation_prompt=True, tokenize=False)
        return text if isinstance(text, str) else str(text)

    try:
        return render(len(messages))
    except Exception as exc:  # a template is code: jinja and the data it reads can raise anything
        reason = f"{type(exc).__name__}: {exc}"
    # the first prefix that fails to render ends with the message to blame
    culprit = next((i for i in range(len(messages)) if not _renders(render, i + 1)), None)
    where = "these messages" if culprit is None else f"message {culprit} (role {messages[culprit]['role']!r})"
    raise InvalidRequestError(f"the chat template cannot render {where}: {reason}")


def _renders(render: Any, upto: int) -> bool:
    try:
        render(upto)
    except Exception:
        return False
    return True


def render_prompt(tokenizer: Any, prompt: Any) -> tuple[str, bool]:
    """Return the text to tokenize and whether the tokenizer should add its special tokens.

    A prompt is raw text, a list of chat messages, or ``{"messages": [...], "tools": [...]}``
    (tool schemas handed to the model's own chat template).
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidRequestError(f"prompt={prompt!r} is empty; give some text")
        _check_text(prompt, "prompt")
        return prompt, True
    tools = None
    if isinstance(prompt, Mapping):
        if _is_message(prompt):
            raise InvalidRequestError(
                "this prompt is one chat message; a chat prompt is a list of messages: wrap it in [ ]"
            )
        unknown = sorted(set(prompt) - {"messages", "tools"})
        if unknown or "messages" not in prompt:
            raise InvalidRequestError(
                f"a dict prompt takes 'messages' (required) and 'tools', or 'prompt_token_ids' alone; "
                f"got keys {sorted(prompt)}"
            )
        prompt, tools = prompt["messages"], prompt.get("tools") or None
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        messages = _check_messages(prompt)
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "chat messages need a chat template and this tokenizer has none; pass the prompt as a string"
            )
        text = _apply_template(tokenizer, messages, tools)
        _check_text(text, "the rendered chat prompt")  # a tool schema or extra message field
        return text, False
    raise InvalidRequestError(
        f"prompt of type {type(prompt).__name__} is not allowed; use a string or a list of chat messages"
    )


def is_token_prompt(prompt: Any) -> bool:
    """Whether `prompt` is given as token ids (``{"prompt_token_ids": [...]}``)."""
    return isinstance(prompt, Mapping) and "prompt_token_ids" in prompt


def token_prompt_ids(tokenizer: Any, prompt: Mapping[str, Any]) -> list[int]:
    """The ids of a token-id prompt, each checked to be a token of this tokenizer."""
    if set(prompt) != {"prompt_token_ids"}:
        raise InvalidRequestError(f"a token-id prompt takes only 'prompt_token_ids'; got keys {sorted(prompt)}")
    ids = prompt["prompt_token_ids"]
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)) or not ids:
        raise InvalidRequestError("prompt_token_ids must be a non-empty list of token ids (integers)")
    size = len(tokenizer)
    for j, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < size:
            raise InvalidRequestError(f"prompt_token_ids[{j}]={token!r} is not a token id of this model "
                                      f"(ids 0..{size - 1})")
    return [int(t) for t in ids]


def prompt_ids(tokenizer: Any, prompt: Any) -> tuple[str, list[int]]:
    """The rendered text and token ids of one prompt, whatever its length (token counting)."""
    if is_token_prompt(prompt):
        ids = token_prompt_ids(tokenizer, prompt)
        return tokenizer.decode(ids), ids
    text, add_special = render_prompt(tokenizer, prompt)
    return text, list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


def longest_token(tokenizer: Any) -> int:
    """Characters in the longest entry of the vocabulary (added tokens included): no token of a
    text covers more, so a text of C characters is at least C / this many tokens."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(token) for token in vocab), default=0)


def encode_prompt(tokenizer: Any, prompt: Any, max_context: int, longest: int = 0) -> list[int]:
    """Tokenize one prompt; refuse it when it leaves no room for one new token. With `longest`
    (`longest_token`), a text too long to fit by its length alone is refused before it is
    tokenized: tokenizing megabytes takes seconds that every other request would wait through.
    The bound counts twice the characters a token can cover (normalizers may merge characters)."""
    if is_token_prompt(prompt):
        ids, text = token_prompt_ids(tokenizer, prompt), "token ids"
    else:
        text, add_special = render_prompt(tokenizer, prompt)
        if longest > 0 and len(text) > 2 * longest * max_context:
            raise InvalidRequestError(
                f"prompt is {len(text)} characters: at least {len(text) // (2 * longest)} tokens, more than the "
                f"model's context of {max_context} tokens (a token here covers at most {longest} characters)"
            )
        ids = list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
    if len(ids) == 0:
        raise InvalidRequestError(f"prompt={text[:60]!r} tokenizes to nothing; give some text")
    if len(ids) >= max_context:
        raise InvalidRequestError(
            f"prompt is {len(ids)} tokens; the model's context is {max_context} tokens, "
            f"so a prompt may have at most {max_context - 1}"
        )
    return ids
