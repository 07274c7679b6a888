"""Kev: many independent questions, one isolated packed forward pass of a local LLM."""

from .engine import Engine
from .engine_like import EngineLike
from .errors import ConstraintError, EngineClosedError, InvalidRequestError, KevError, UnknownAdapterError
from .params import Defaults, SamplingParams
from .request import Completion

__all__ = [
    "Completion",
    "ConstraintError",
    "Defaults",
    "Engine",
    "EngineClosedError",
    "EngineLike",
    "InvalidRequestError",
    "KevError",
    "SamplingParams",
    "UnknownAdapterError",
]
