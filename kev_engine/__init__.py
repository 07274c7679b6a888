"""Kev: many independent questions, one isolated packed forward pass of a local LLM.

This module is the engine's public surface: what applications and `kev_integrations` use. The
subpackages are the engine's stages, in the order a question flows (docs/architecture.md):
`inputs` → `core` → `model` (with `models`, `adapters` and `platforms`) → `sample` → `outputs`;
`tools` holds the `kev` commands. Their modules may change between releases; the names below do
not without a deprecation. Besides what applications use, other `EngineLike`s (RemoteEngine, the
server) take `Arrival` (an announced request), `Delivery` and `Mailbox` (callbacks run in order per
request, off the caller's thread), `Histogram` and `merged_histograms` (latency histograms, merged
across Ray replicas), `on_passing_thread` (torch work off a long-lived thread, whose OpenMP team
would stay beside the engine's).
"""

from __future__ import annotations

from typing import Any

from .adapters.pool import check_name as check_adapter_name
from .core.arrivals import Arrival
from .core.delivery import Delivery, Mailbox
from .core.latency import Histogram
from .core.latency import merged as merged_histograms
from .engine import Engine
from .engine_like import EngineLike
from .errors import (
    AdapterError,
    ConstraintError,
    EngineClosedError,
    InvalidRequestError,
    KevError,
    PassFailedError,
    UnknownAdapterError,
)
from .inputs.params import (
    CONSTRAINT_FIELDS,
    INT_FIELDS,
    MAX_N,
    MAX_TOP_LOGPROBS,
    SETTING_FIELDS,
    SETTINGS,
    TEMPERATURE_ENV,
    Defaults,
    SamplingParams,
    coerce_sampling,
)
from .inputs.tokenize import Prompt, prompt_ids
from .loader import EMBEDDED_NAME, resolve_device, resolve_dtype
from .platforms.threads import on_passing_thread
from .results import Completion, FinishReason, TextPiece, TokenLogprob
from .sample.logprobs import PromptLogprobs

__all__ = [
    # the engine and what it answers
    "Completion",
    "Engine",
    "PromptLogprobs",
    "EngineLike",
    "FinishReason",
    "TextPiece",
    # settings
    "CONSTRAINT_FIELDS",
    "Defaults",
    "INT_FIELDS",
    "MAX_N",
    "MAX_TOP_LOGPROBS",
    "SETTING_FIELDS",
    "SETTINGS",
    "SamplingParams",
    "TEMPERATURE_ENV",
    "coerce_sampling",
    # prompts and models
    "EMBEDDED_NAME",
    "Prompt",
    "check_adapter_name",
    "prompt_ids",
    "resolve_device",
    "resolve_dtype",
    # errors
    "AdapterError",
    "ConstraintError",
    "EngineClosedError",
    "InvalidRequestError",
    "KevError",
    "PassFailedError",
    "UnknownAdapterError",
    # for front ends and other EngineLikes (RemoteEngine, the server)
    "Arrival",
    "Delivery",
    "Histogram",
    "Mailbox",
    "TokenLogprob",
    "merged_histograms",
    "on_passing_thread",
    # the `kev` command's parts (imported on first use): `cli.main`, `cli.Command`
    "cli",
]


def __getattr__(name: str) -> Any:
    """`kev_engine.cli` on first use: the command line's imports (argparse, the pack drawing's
    Pillow) stay out of `import kev_engine`."""
    if name == "cli":
        from .tools import cli

        return cli
    raise AttributeError(f"module 'kev_engine' has no attribute {name!r}")
