"""Engine `Completion`s → OpenAI response objects and stream chunks (chat and text completions)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from kev_engine import Completion

from .chat_prompt import reply_tool_calls


def sse(data: Any) -> str:
    """One server-sent event: a JSON object, or a bare marker such as "[DONE]"."""
    return "data: " + (data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)) + "\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(completions: Sequence[Completion]) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in completions)
    generated = sum(c.completion_tokens for c in completions)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in completions)},
    }


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
    message, finish = chat_message(completion, tool_names)
    return {
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage([completion]),
    }


def completion_response(completions: Sequence[Completion], model: str) -> dict[str, Any]:
    return {
        "id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
                    for i, c in enumerate(completions)],
        "usage": usage(completions),
    }


class ChunkWriter:
    """The chunks of one streamed response: one id and creation time for all of them."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def text(self, index: int, piece: str, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": piece}
            if first:
                delta["role"] = "assistant"
            return self._chunk([{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}])
        return self._chunk([{"index": index, "text": piece, "finish_reason": None, "logprobs": None}])

    def finish(self, index: int, completion: Completion, tool_names: Sequence[str]) -> dict[str, Any]:
        """The closing chunk of one choice (tool calls, parsed once the reply is whole, ride on it)."""
        if not self.chat:
            return self._chunk([{"index": index, "text": "", "finish_reason": completion.finish_reason,
                                 "logprobs": None}])
        message, finish = chat_message(completion, tool_names)
        delta: dict[str, Any] = {}
        if tool_names:  # with tools bound nothing was streamed: the text (if any) comes whole, here
            delta["role"] = "assistant"
            if message["content"]:
                delta["content"] = message["content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        return self._chunk([{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}])

    def usage(self, completions: Sequence[Completion]) -> dict[str, Any]:
        return self._chunk([], usage=usage(completions))
