"""Constructor arguments for both front ends: the settings' fields, unknown names refused,
sampling checked up front.

The sampling fields of LangChain's and LlamaIndex's models are generated from the engine's one
declaration (`kev_engine.SETTINGS`), so a type, a bound or a description is written once. pydantic
models drop unknown keyword arguments by default, so ``ChatKev(num_predict=8)`` would run with 256
new tokens and say nothing: Kev refuses them, naming the right field. And the settings go through
`SamplingParams` at construction, not at the first call.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from pydantic import Field, create_model

from kev_engine import CONSTRAINT_FIELDS, SETTING_FIELDS, SETTINGS, SamplingParams

from .retry import check_max_retries

SETTING_KEYS = ("adapter", *SETTING_FIELDS, *CONSTRAINT_FIELDS)
"""What a field, a bind, a call or a scope may set: the adapter and every `SamplingParams` field,
derived from the engine so that a new setting reaches both front ends."""

# names other libraries use for Kev's fields: what to write instead
RENAMED = {
    "num_predict": "max_tokens", "max_new_tokens": "max_tokens", "max_length": "max_tokens",
    "n_predict": "max_tokens", "max_output_tokens": "max_tokens", "num_output": "max_tokens",
    "max_tokens_to_sample": "max_tokens", "model_name": "model", "model_path": "model", "model_id": "model",
    "lora": "adapter", "lora_adapter": "adapter", "adapter_name": "adapter", "random_seed": "seed",
    "stop_sequences": "stop", "request_timeout": "timeout",
}
CONTEXT_WINDOW_NAMES = ("context_window", "num_ctx", "n_ctx", "context_length", "max_context")


def settings_model(name: str, base: Any, skip: Collection[str] = (), valued: Collection[str] = ()) -> Any:
    """A subclass of the pydantic model `base` with a field for each engine setting but those in `skip`:
    its type, bounds and description as `kev_engine.SETTINGS` declares them. A setting in `valued`
    defaults to the engine's own value; any other to None, which leaves it to the engine. (`base`
    is typed Any: type checkers refuse an abstract class, such as LlamaIndex's LLM, as a `type`.)"""
    fields: dict[str, Any] = {}
    for setting in SETTINGS:
        if setting.name in skip:
            continue
        if setting.name in valued:
            annotation, default = setting.annotation, setting.default
        else:
            annotation, default = setting.annotation | None, None
        field = Field(default, description=setting.description, ge=setting.ge, gt=setting.gt, le=setting.le)
        fields[setting.name] = (annotation, field)
    return create_model(name, __base__=base, **fields)


def hint(name: str, allowed: Iterable[str], owner: str) -> str:
    """What to write instead of `name` (a field of `owner` named differently elsewhere, or a close one)."""
    if name in CONTEXT_WINDOW_NAMES:
        return ("the context window is not a setting: it is read from the model's config "
                "(engine.max_context; LlamaIndex's Kev reports it as llm.metadata.context_window)")
    allowed = list(allowed)
    if RENAMED.get(name) in allowed:
        return f"use {RENAMED[name]}= instead"
    close = difflib.get_close_matches(name, allowed, n=1)
    return f"did you mean {close[0]}=?" if close else f"{owner} takes {sorted(allowed)}"


def refuse_unknown(owner: str, values: Any, allowed: Iterable[str]) -> None:
    """Raise TypeError for constructor arguments that are no field of `owner`, naming the right one."""
    if not isinstance(values, Mapping):
        return
    allowed = set(allowed)
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise TypeError("; ".join(f"{owner}() got an unknown argument {name!r}: {hint(name, allowed, owner)}"
                                  for name in unknown))


def check_retries(max_retries: Any, base_url: str | None) -> None:
    """`max_retries` retries requests to a `kev serve` (`base_url`); in-process it cannot mean anything."""
    if max_retries is None:
        return
    check_max_retries(max_retries)
    if max_retries and base_url is None:
        raise ValueError(
            f"max_retries={max_retries} needs base_url=: it retries requests to a `kev serve` that failed to "
            "connect or were refused for now (429, 503). Without base_url the model runs in this process, "
            "where no request goes over a network: leave max_retries unset"
        )


def check_sampling(values: Mapping[str, Any]) -> None:
    """Validate sampling fields now, with the engine's own rules (`InvalidRequestError` naming the value)."""
    SamplingParams.from_dict(values)
