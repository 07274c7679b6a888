"""Ray Data: `KevPredictor`, where every batch of rows is one packed `Engine.generate` call.

Where this sits: ``ds.map_batches(KevPredictor, batch_size=B, compute=ActorPoolStrategy(size=N))``
starts N actors, each loading one `Engine`; Ray hands each actor batches of B rows, and this file
only turns the rows into requests and the completions back into columns. The packing is the
engine's: the rows of a batch share passes exactly as ``engine.generate(prompts)`` would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeAlias

import numpy as np
import pandas as pd

from kev_engine import (
    INT_FIELDS,
    SETTING_FIELDS,
    Completion,
    Engine,
    InvalidRequestError,
    KevError,
    Prompt,
    SamplingParams,
)

# The per-row settings: SamplingParams' own list less the reply constraints — a dataset's own
# columns (a multiple-choice eval's `choice`, a `regex` field) must never silently constrain the
# reply — and less what would need output columns a row does not have (`n` samples, `logprobs`).
# Constraints and those can be given to every row with `sampling=`.
SETTING_COLUMNS = tuple(name for name in SETTING_FIELDS if name not in ("n", "logprobs", "top_logprobs"))

Batch: TypeAlias = "dict[str, np.ndarray] | pd.DataFrame"
Row = tuple[Prompt, SamplingParams, str | None]


class KevPredictor:
    """A callable class for Ray Data: each batch of rows is ONE ``Engine.generate`` call (one pack).

    Ray runs it as a pool of actors, ``compute=ray.data.ActorPoolStrategy(size=N)`` (Ray 2.51+
    still takes ``concurrency=N``, with a deprecation warning).

    Setup:
        ``pip install 'kev-llm[ray]'``

    Key init args (``fn_constructor_kwargs``; one engine is loaded per actor):
        model: a local folder, a .gguf file or a hub id; None = the embedded SmolLM2-135M-Instruct.
        adapters: LoRA adapters to load, name → PEFT folder; a row picks one in its `adapter` column.
        dtype, device: the engine's ("float32", "cuda", ...); None = the loader's choice.
        sampling: settings for every row (any `SamplingParams` field, e.g. ``{"max_tokens": 64}``);
            a row's own setting columns override them.
        engine_kwargs: passed to `Engine` (``max_num_seqs``, ``max_batch_tokens``, ...).

    Input columns (others are kept and ignored):
        ``prompt`` (text) or ``messages`` (chat: a list of ``{"role", "content"}``), exactly one
        per row; optional ``adapter`` and any sampling setting by its `SamplingParams` name
        (`SETTING_COLUMNS`: ``temperature``, ``top_p``, ``top_k``, ``max_tokens``, ``seed``, ``stop``
        — a string or a list of them —, ``cache_salt``, the penalties, ``min_p``, ``logit_bias``,
        ``stop_token_ids``, ``min_tokens``, ``ignore_eos``; not constraints, ``n`` or logprobs).
        A missing value (None, NaN, pandas' NA) is unset.

    Output columns (added; an input column of the same name is replaced):
        ``text``, ``finish_reason`` ("stop" or "length"), ``prompt_tokens``, ``completion_tokens``,
        ``cached_tokens`` and ``error`` (None when answered). A row that is refused (no prompt, a bad setting, an
        unknown adapter) or fails gets ``error`` = what was wrong, ``text`` = "",
        ``finish_reason`` = "error" and 0 tokens, so every output column keeps one type whichever
        rows a batch holds; the other rows of its batch are answered and the job goes on.

    Run:
        .. code-block:: python

            import ray
            from kev_integrations.ray import KevPredictor

            ds = ray.data.read_json("questions.jsonl")  # a `prompt` or `messages` column
            answers = ds.map_batches(
                KevPredictor, fn_constructor_kwargs={"sampling": {"max_tokens": 64}}, batch_size=32,
                compute=ray.data.ActorPoolStrategy(size=2, max_tasks_in_flight_per_actor=1), num_cpus=1,
            )

    ``max_tasks_in_flight_per_actor=1``: a batch is seconds of work, and by default Ray queues
    several batches on the first actor that is up, where they wait while the others sit idle.

    A batch is one pack when it fits one pass: at most ``max_num_seqs`` rows (64) and
    ``max_batch_tokens`` prompt tokens (8192); a bigger batch is still one call, which the engine
    runs as several passes. Ray turns an integer column with gaps into float64, so a whole float
    is read back as an integer (seeds above 2**53 arrive rounded: give them without gaps).
    """

    def __init__(
        self,
        model: str | None = None,
        adapters: dict[str, str] | None = None,
        dtype: str | None = None,
        device: str | None = None,
        sampling: Mapping[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.sampling = dict(sampling or {})
        SamplingParams.from_dict(self.sampling)  # a bad default fails the actor at start, not every row
        self.engine = Engine.from_pretrained(model, device=device, dtype=dtype, adapters=adapters, **engine_kwargs)

    def __call__(self, batch: Batch) -> Batch:
        """Answer a batch (numpy dict of columns, or a pandas frame) with one `generate` call."""
        columns = batch if isinstance(batch, dict) else {name: batch[name].to_numpy() for name in batch.columns}
        num_rows = len(batch) if isinstance(batch, pd.DataFrame) else len(next(iter(columns.values()), []))
        requests = [self._read_row(columns, i) for i in range(num_rows)]
        rows = [r for r in requests if isinstance(r, tuple)]
        answers = iter(self.engine.generate(  # the one call: every valid row of the batch in one pack
            [r[0] for r in rows], [r[1] for r in rows], return_exceptions=True, adapters=[r[2] for r in rows]
        ) if rows else [])
        added = _output_columns([next(answers) if isinstance(r, tuple) else r for r in requests])
        if isinstance(batch, pd.DataFrame):
            return batch.assign(**{name: pd.Series(values, index=batch.index, dtype=values.dtype)
                                   for name, values in added.items()})
        return {**{name: _as_lists(values) for name, values in batch.items()}, **added}

    def _read_row(self, columns: Mapping[str, np.ndarray], i: int) -> Row | BaseException:
        """Row i as (prompt, settings, adapter), or the error that refuses it."""
        try:
            question = _question(_cell(columns, "prompt", i), _cell(columns, "messages", i))
            settings = dict(self.sampling)
            for name in SETTING_COLUMNS:
                value = _cell(columns, name, i)
                if value is not None:
                    settings[name] = _as_int(value) if name in INT_FIELDS else value
            return question, SamplingParams.from_dict(settings), _cell(columns, "adapter", i)
        except KevError as exc:
            return exc


def _question(prompt: Any, messages: Any) -> Prompt:
    """The row's text prompt or chat: exactly one, each of its own kind (a list in `prompt` would
    otherwise be taken for chat, a string in `messages` for text)."""
    if (prompt is None) == (messages is None):
        has = "both" if prompt is not None else "neither"
        raise InvalidRequestError(f"this row has {has} of 'prompt' and 'messages'; give exactly one")
    if messages is None:
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt={prompt!r} is not allowed; use a string (chat goes in 'messages')")
        return prompt
    if not isinstance(messages, list):
        raise InvalidRequestError(
            f"messages={messages!r} is not allowed; use a list of chat messages (dicts with 'role' and 'content')"
        )
    # Arrow gives every message every key any message in the column has: a key another message
    # brought (`name`, `tool_calls`) arrives as None and must not reach the chat template
    return [{k: v for k, v in m.items() if v is not None or k == "content"} if isinstance(m, dict) else m
            for m in messages]


def _cell(columns: Mapping[str, np.ndarray], name: str, i: int) -> Any:
    """Row i of a column as a plain Python value; None where the column or the value is missing.

    Arrow hands numpy scalars (np.int64, np.str_, np.bool_: SamplingParams refuses them), lists as
    numpy arrays, and a missing value as None, NaN or pandas' NA depending on the column's type.
    """
    if name not in columns:
        return None
    value = columns[name][i]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _as_int(value: Any) -> Any:
    """3.0 → 3: an integer column with gaps arrives as float64. Anything else is left for
    SamplingParams to accept or refuse by name."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _as_lists(column: np.ndarray) -> np.ndarray:
    """Ray's numpy format hands a list column (`messages`, `stop`) as numpy arrays, which it cannot
    turn back into an Arrow list (it pickles them, with a warning): hand such a column back as lists."""
    if column.dtype != object or column.ndim != 1 or not any(isinstance(v, np.ndarray) for v in column):
        return column
    lists = np.empty(len(column), dtype=object)
    for i, value in enumerate(column):  # one by one: equal-length lists would otherwise make a 2-D array
        lists[i] = value.tolist() if isinstance(value, np.ndarray) else value
    return lists


def _output_columns(results: list[Completion | BaseException]) -> dict[str, np.ndarray]:
    """The added columns, with one type each whatever the batch holds (Arrow concatenates them)."""
    ok = [r if isinstance(r, Completion) else None for r in results]
    return {
        "text": np.array([r.text if r else "" for r in ok], dtype=object),
        "finish_reason": np.array([r.finish_reason if r else "error" for r in ok], dtype=object),
        "prompt_tokens": np.array([r.prompt_tokens if r else 0 for r in ok], dtype=np.int64),
        "completion_tokens": np.array([r.completion_tokens if r else 0 for r in ok], dtype=np.int64),
        "cached_tokens": np.array([r.cached_tokens if r else 0 for r in ok], dtype=np.int64),
        "error": np.array([None if isinstance(r, Completion) else _describe(r) for r in results], dtype=object),
    }


def _describe(exc: BaseException) -> str:
    """Kev's own errors already name the bad value and what is allowed; anything else gets its type."""
    return str(exc) if isinstance(exc, KevError) else f"{type(exc).__name__}: {exc}"
