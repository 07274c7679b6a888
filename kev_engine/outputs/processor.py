"""The outputs processor: what a pass drew, onto its requests, and out to their callers.

Where this sits: the last two stages of `Stepper.step`. `record` puts each drawn token on its
request (its logprobs, its text, whether it finished: `unpack.append_token`) and posts the new
text to the request's `on_text`; `deliver` resolves the futures of those that finished, once the
scheduler has freed what they held. Callers' code never runs here: both post to the request's
mailbox, drained by the delivery threads (`delivery`), so a slow callback stalls no pass.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from ..core.delivery import Delivery
from ..core.plan import Chunk
from ..core.request import Request
from ..model.pack import PackedBatch
from ..results import TextPiece
from ..sample.sample import Draw
from .detokenize import Detokenizer
from .unpack import append_token, text_delta

Finished = list[tuple[Request, BaseException | None]]  # each finished request, with its error if it failed


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_ids: Collection[int], delivery: Delivery) -> None:
        self.detokenizer = Detokenizer(tokenizer)  # each reply's text, token by token
        self.eos_ids = eos_ids
        self.delivery = delivery  # on_text and results reach callers from its threads, never from a pass
        self.generated_tokens = 0

    def record(self, chunks: Sequence[Chunk], batch: PackedBatch, logits: torch.Tensor,
               draws: Sequence[Draw]) -> Finished:
        """Each request's share of a pass the scheduler has recorded (`Scheduler.update`): a
        prompt_logits request keeps its rows' logits (and is done at its prompt's end), a drawn
        token goes onto its request. Returns those now done."""
        finished: Finished = []
        for i, chunk in enumerate(chunks):
            request = chunk.request
            if request.all_logits:
                first, last = batch.logits_rows[i]
                request.logits.append(logits[first:last].clone())  # its own memory, not a view of the pass
                if not request.in_prefill:  # the scheduler has counted this pass's tokens in
                    finished.append((request, None))
        for draw in draws:
            self.take(draw, logits, finished)
        return finished

    def take(self, draw: Draw, logits: torch.Tensor, finished: Finished) -> None:
        """One drawn token onto its request: its logprobs, its text, whether it finished; streamed."""
        request, row, token, logprob = draw
        self.generated_tokens += 1
        if isinstance(token, BaseException):
            finished.append((request, token))
            return
        if request.capture_logits:
            request.logits.append(logits[row].clone())
        if logprob is not None and request.logprobs is not None:
            request.logprobs.append(logprob)
        if append_token(request, token, self.eos_ids, self.detokenizer):
            finished.append((request, None))
        self._stream(request)

    def deliver(self, finished: Finished) -> None:
        """Hand each finished request's caller its result, or its error where it has one (after
        every piece it streamed)."""
        for request, error in finished:
            self._resolve(request, request.result() if error is None else None, error)

    def _stream(self, request: Request) -> None:
        """Post a request's new text to its `on_text` (run by the delivery threads, after what it
        was posted before: this pass never waits for the callback). If the callback raises, the
        request's future fails and the next pass frees it (`Scheduler.cancel`). The piece
        carries its sample's index and the logprobs of the tokens since the previous piece."""
        if request.on_text is not None and (delta := text_delta(request)):
            logprobs = None
            if request.logprobs is not None:
                logprobs = request.logprobs[request.logprobs_streamed:]
                request.logprobs_streamed = len(request.logprobs)
            piece = TextPiece(delta, request.sample_index, logprobs)
            self.delivery.post_text(request.mailbox, request.future, request.on_text, piece)

    def _resolve(self, request: Request, result: Any, exc: BaseException | None = None) -> None:
        """Resolve a request's future after every piece of text it streamed (its done callbacks
        then run on a delivery thread, not in a pass)."""
        self.delivery.post_result(request.mailbox, request.future, result, exc)
