"""Engine `Completion`s → OpenAI response objects and stream chunks (chat and text completions).

A request with ``n`` > 1 answers each prompt with n choices: a prompt's `Completion` holds them
in `samples`, and choice indices run prompt-major (prompt i, sample j → ``i * n + j``), as
OpenAI numbers them. Logprobs take each endpoint's own shape: chat's ``{"content": [{token,
logprob, bytes, top_logprobs}]}``, completions' ``{tokens, token_logprobs, top_logprobs,
text_offset}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from kev_engine import Completion, TokenLogprob

from ..logprob_format import chat_logprobs, echoed_text_logprobs, text_logprobs
from .chat_prompt import reply_tool_calls
from .echo import EchoedPrompt


def sse(data: Any) -> str:
    """One server-sent event: a JSON object, or a bare marker such as "[DONE]"."""
    return "data: " + (data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)) + "\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(completions: Sequence[Completion]) -> dict[str, Any]:
    """Usage of prompt-level completions: each prompt counted once, however many samples it has."""
    prompt = sum(c.prompt_tokens for c in completions)
    generated = sum(c.completion_tokens for c in choices_of(completions))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in completions)},
    }


def choices_of(completions: Sequence[Completion]) -> list[Completion]:
    """Every choice of a response, in index order: each prompt's samples (or itself when n = 1)."""
    return [choice for c in completions for choice in (c.samples or (c,))]


def chat_message(completion: Completion, tool_names: Sequence[str]) -> tuple[dict[str, Any], str]:
    """The assistant message and its finish_reason ("tool_calls" when it called tools)."""
    text, calls = (reply_tool_calls(completion.text, tool_names, completion.finish_reason) if tool_names
                   else (completion.text, []))
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    finish: str = completion.finish_reason
    if calls:
        message["tool_calls"] = calls
        finish = "tool_calls" if finish == "stop" else finish
    return message, finish


def chat_response(completion: Completion, model: str, tool_names: Sequence[str]) -> dict[str, Any]:
    choices = []
    for i, choice in enumerate(choices_of([completion])):
        message, finish = chat_message(choice, tool_names)
        choices.append({"index": i, "message": message, "finish_reason": finish,
                        "logprobs": chat_logprobs(choice.logprobs)})
    return {
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": choices, "usage": usage([completion]),
    }


def completion_response(completions: Sequence[Completion], model: str,
                        echoed: Sequence[EchoedPrompt] | None = None) -> dict[str, Any]:
    """The response to prompt-level `completions`; with `echoed` (one per prompt), each choice's
    text and logprobs start with its prompt's."""
    choices: list[dict[str, Any]] = []
    for i, completion in enumerate(completions):
        echo = echoed[i] if echoed is not None else None
        for choice in completion.samples or (completion,):
            choices.append({"index": len(choices), **_text(choice, echo), "finish_reason": choice.finish_reason})
    return {
        "id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": choices, "usage": usage(completions),
    }


def _text(choice: Completion, echo: EchoedPrompt | None) -> dict[str, Any]:
    """A completion choice's text and logprobs, after its prompt's when echoed."""
    if echo is None:
        return {"text": choice.text, "logprobs": text_logprobs(choice.logprobs)}
    answer = text_logprobs(choice.logprobs, len(echo.text))
    logprobs = answer if echo.logprobs is None else echoed_text_logprobs(echo.first_token, echo.logprobs, answer)
    return {"text": echo.text + choice.text, "logprobs": logprobs}


class ChunkWriter:
    """The chunks of one streamed response: one id and creation time for all of them.

    Logprobs ride on the chunk of the text their tokens made; those of tokens whose text never
    streamed (an end-of-sequence token, a reply with tools bound) ride on the choice's closing
    chunk, so a client that concatenates them has every token's once, in order.

    With `prompt_tokens` (each prompt's count: vLLM's ``continuous_usage_stats``) every choice
    chunk carries the usage of its choice so far, as vLLM's do: its prompt's tokens and the
    tokens generated for it up to that chunk. The engine counts those by their logprobs, which it
    then computes for every request; `show_logprobs` False keeps them out of the chunks."""

    def __init__(self, chat: bool, model: str, n: int = 1, prompt_tokens: Sequence[int] | None = None,
                 show_logprobs: bool = True) -> None:
        self.chat, self.model, self.n = chat, model, n
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.prompt_tokens, self.show_logprobs = prompt_tokens, show_logprobs
        self._chars: dict[int, int] = {}  # choice index → characters streamed (completions' text_offset)
        self._reported: dict[int, int] = {}  # choice index → logprob entries streamed
        self._generated: dict[int, int] = {}  # choice index → tokens generated so far (continuous usage)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _choice_chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        """The chunk of one choice's delta, with that choice's usage so far when asked for."""
        if self.prompt_tokens is None:
            return self._chunk([choice])
        prompt, generated = self.prompt_tokens[choice["index"] // self.n], self._generated.get(choice["index"], 0)
        return self._chunk([choice], usage={"prompt_tokens": prompt, "completion_tokens": generated,
                                            "total_tokens": prompt + generated})

    def _logprobs(self, index: int, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        self._reported[index] = self._reported.get(index, 0) + len(entries)
        return chat_logprobs(entries) if self.chat else text_logprobs(entries, self._chars.get(index, 0))

    def text(self, index: int, piece: str, first: bool = False,
             logprobs: Sequence[TokenLogprob] | None = None) -> dict[str, Any]:
        self._generated[index] = self._generated.get(index, 0) + len(logprobs or ())  # one entry a token
        reported = self._logprobs(index, logprobs if self.show_logprobs else None)
        self._chars[index] = self._chars.get(index, 0) + len(piece)
        if self.chat:
            delta: dict[str, Any] = {"content": piece}
            if first:
                delta["role"] = "assistant"
            return self._choice_chunk({"index": index, "delta": delta, "finish_reason": None, "logprobs": reported})
        return self._choice_chunk({"index": index, "text": piece, "finish_reason": None, "logprobs": reported})

    def finish(self, index: int, completion: Completion, tool_names: Sequence[str]) -> dict[str, Any]:
        """The closing chunk of one choice (tool calls, parsed once the reply is whole, ride on it)."""
        self._generated[index] = completion.completion_tokens
        shown = completion.logprobs if self.show_logprobs else None
        left = None if shown is None else shown[self._reported.get(index, 0):]
        reported = self._logprobs(index, left) if left else None
        if not self.chat:
            return self._choice_chunk({"index": index, "text": "", "finish_reason": completion.finish_reason,
                                       "logprobs": reported})
        message, finish = chat_message(completion, tool_names)
        delta: dict[str, Any] = {}
        if tool_names:  # with tools bound nothing was streamed: the text (if any) comes whole, here
            delta["role"] = "assistant"
            if message["content"]:
                delta["content"] = message["content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        return self._choice_chunk({"index": index, "delta": delta, "finish_reason": finish, "logprobs": reported})

    def usage(self, completions: Sequence[Completion]) -> dict[str, Any]:
        return self._chunk([], usage=usage(completions))
