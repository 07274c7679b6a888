"""An agent's step tells the engine its caller comes back, so agents side by side share a pass.

An agent asks with tools offered; a reply that calls a tool (or tried to: a cut call comes back
as an error result) brings it back once the tool ran. Several agents' calls of one round finish
a few decode steps apart, and without a word each follow-up would start a pass of its own:
`Engine.expect_follow_up` lets the follow-ups that came wait for the others (`kev_engine.core.arrivals`).
The LangChain and LlamaIndex front ends say it for every call with tools offered, take it back at
once when the answer calls none, and submit a question whose last message is a tool result as a
follow-up (`submit_options`). Every `EngineLike` takes both; a remote one ignores them (its server
coalesces what arrives).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from kev_engine import Completion, EngineLike

from .tool_format import split_tool_calls


def submit_options(follow_up: bool) -> dict[str, Any]:
    """`submit`'s keyword for a question that continues after a tool result (an agent's follow-up)."""
    return {"follow_up": True} if follow_up else {}


class FollowUp:
    """The expectation of one call's follow-up: `answered` with its completion, or `abandon`ed
    when the caller stops first."""

    def __init__(self, engine: EngineLike, future: Future[Any], tool_names: Sequence[str]) -> None:
        self._names = list(tool_names)
        self._handle = engine.expect_follow_up(future) if self._names else None

    def answered(self, completion: Completion) -> Completion:
        """The answer is in: a call keeps its caller expected (the engine bounds how long), an
        answer that calls no tool ends the expectation."""
        handle, self._handle = self._handle, None
        if handle is not None:
            _, calls, invalid = split_tool_calls(completion.text, self._names, finish_reason=completion.finish_reason)
            if not (calls or invalid):
                handle.end()
        return completion

    def abandon(self) -> None:
        """The caller stopped before the answer (an error, a cancelled wait, a stream left early):
        nobody comes back. A no-op once answered."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.end()
