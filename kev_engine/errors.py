"""Errors a caller can cause. Each names the bad value and what is allowed.

`InvalidRequestError` subclasses `ValueError` so plain `except ValueError` keeps working;
it fails only its own request — the rest of a pack is still answered.
"""

from __future__ import annotations


class KevError(Exception):
    """Base class of every error Kev raises on purpose."""


class InvalidRequestError(KevError, ValueError):
    """A prompt or a sampling setting that Kev refuses (empty, too long, out of range...).

    `param`: the argument it is about where that is one ("prompt", "logit_bias", "json_schema"...),
    so a front end can name the field its caller sent (an OpenAI error's `param`)."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConstraintError(InvalidRequestError):
    """A reply constraint (schema, regex, grammar...) that cannot be compiled, or that leaves no
    token to generate: fails its own request with what was wrong."""


class UnknownAdapterError(KevError, KeyError):
    """A request named an adapter the engine does not know."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class AdapterError(KevError, ValueError):
    """An adapter Kev refuses to load; the message names the adapter and the reason."""


class EngineClosedError(KevError, RuntimeError):
    """The engine was shut down while the request waited."""


class PassFailedError(KevError, RuntimeError):
    """The forward pass a request was part of raised; `__cause__` holds what it raised."""
