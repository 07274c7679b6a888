"""`EngineLike`: what the integrations ask of an engine, so they run on any that has it.

`Engine` (in process) and `kev_integrations.remote.RemoteEngine` (a `kev serve` over HTTP)
both satisfy it, structurally; so does a test's fake, which then records the `SamplingParams`
it receives instead of imitating the engine. Operator-side calls (stats, defaults, draining
adapters) stay on `Engine`: the server and Ray own a local one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from .results import Completion


class Expectation(Protocol):
    """What `expect_follow_up` hands back: `end()` it when no follow-up will come."""

    def end(self) -> None:
        ...


@runtime_checkable
class EngineLike(Protocol):
    name: str
    """The model's name (what `/v1/models` lists and LangChain reports)."""
    max_context: int
    """Prompt plus answer tokens one request may reach."""
    tokenizer: Any
    """Has the chat template; a remote one renders it but holds no vocabulary."""

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters loaded, by name."""
        ...

    def load_adapter(self, name: str, path: str) -> None:
        """Make adapter `name` usable (a remote engine only checks that the server has it)."""
        ...

    def encode(self, prompt: Any) -> list[int]:
        """The exact token ids fed for `prompt`."""
        ...

    def submit(self, prompt: Any, sampling: Any = None, adapter: str | None = None,
               on_text: Callable[[str], None] | None = None, follow_up: bool = False) -> Future[Completion]:
        """Queue one question; a bad one gets a future that fails alone. `follow_up`: it continues
        after an answer whose caller was expected back (`expect_follow_up`)."""
        ...

    def expect_follow_up(self, future: Future[Any]) -> Expectation:
        """`future`'s caller asks again once answered (an agent's tool step), so a round's
        follow-ups can share a pass; an engine that does not coalesce this way returns a handle
        whose `end` does nothing."""
        ...

    def generate(self, prompts: Sequence[Any], sampling: Any = None, return_exceptions: bool = False,
                 adapters: Any = None) -> list[Any]:
        """Answer all prompts packed together, in order (exceptions in place with `return_exceptions`)."""
        ...

    def hold(self) -> AbstractContextManager[None]:
        """Everything submitted inside joins one pass."""
        ...

    def close(self) -> None:
        ...
