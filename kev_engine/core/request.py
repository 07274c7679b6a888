"""Per-request state, from submission to its `Completion` (nano-vllm's `Sequence`).

A request knows its prompt ids, its resolved sampling settings (with the settings version
it was resolved under), its status, the KV blocks it holds and how many of its tokens are
already in them, what it has generated, and the future its caller waits on.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..inputs.params import SamplingParams
from ..results import Completion, FinishReason, TokenLogprob
from .blocks import BlockTable
from .delivery import Mailbox
from .drafts import Drafter


class Status(enum.Enum):
    WAITING = "waiting"  # queued; holds no KV
    RUNNING = "running"  # admitted: holds KV blocks (and its adapter's slot)
    FINISHED = "finished"  # left the engine; everything it held is freed


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams  # resolved: temperature is never None here
    settings_version: int
    max_total: int  # prompt + new tokens the request may reach (clamped to the context)
    future: Future = field(default_factory=Future)
    adapter: str | None = None
    prefix_key: Hashable = None  # what besides tokens shapes its KV: (adapter, its version, cache_salt)
    all_logits: bool = False  # prompt_logits: every prompt position's logits, no sampling
    capture_logits: bool = False  # kev verify: keep the logits each generated token was sampled from
    group: int = 0  # requests submitted together share a group and are admitted together
    follow_up: bool = False  # an answer's expected follow-up (`arrivals`): it may wait for its round's others
    queued_at: float = field(default_factory=time.monotonic)  # when it was queued (its wait is a stat)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens already in its KV blocks
    cached_tokens: int = 0  # of those, prompt tokens reused from a shared prefix
    blocks: BlockTable = field(default_factory=BlockTable)
    logits: list[torch.Tensor] = field(default_factory=list)  # all_logits: [n, vocab] per chunk
    generator: torch.Generator | None = None
    num_admissions: int = 0  # more than one: it was preempted and recomputed
    text: str = ""
    text_ids: int = 0  # output ids whose text is `text_head`: decoding starts after them (`detokenize`)
    text_head: str = ""
    finish_reason: FinishReason | None = None
    on_text: Callable[[str], None] | None = None  # streaming: called with each new piece of text
    streamed: int = 0  # characters of `text` already posted to on_text
    mailbox: Mailbox = field(default_factory=Mailbox)  # its on_text pieces, then its result, in order
    grammar: Any = None  # constrained requests: the compiled grammar its replies follow
    matcher: Any = None  # of that grammar, its own xgrammar GrammarMatcher (the sampler's), advanced per token
    logprobs: list[TokenLogprob] | None = None  # logprobs=True: one per output token
    logprobs_streamed: int = 0  # of those, already posted to on_text with a piece
    prompt_set: torch.Tensor | None = None  # repetition_penalty: the prompt's distinct ids (`penalties`)
    sample_index: int = 0  # which of its prompt's n samples this request is
    siblings: list[Request] = field(default_factory=list)  # n > 1, before the first token: the other samples,
    # forked from this one's prefill (`fanout`) when it samples its first token
    drafter: Drafter | None = None  # speculation on: its drafts' n-gram index and record (`drafts`)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def decoding(self) -> bool:
        """Past its prompt, with only its last token still to compute: its next pass is a decode row."""
        return not self.in_prefill and self.num_tokens - self.num_computed == 1

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(
            text=self.text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            adapter=self.adapter,
            settings_version=self.settings_version,
            cached_tokens=self.cached_tokens,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )

    def result(self) -> Any:
        """What the caller's future receives: a `Completion`, or the prompt's logits [len, vocab]."""
        if self.all_logits:
            return torch.cat(self.logits)
        if self.capture_logits:
            return self.completion(), torch.stack(self.logits)  # [completion_tokens, vocab]
        return self.completion()
