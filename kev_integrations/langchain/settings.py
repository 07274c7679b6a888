"""Per-call settings shared by `KevLLM` and `ChatKev`: fields → one `SamplingParams` + adapter.

A setting may come from a constructor field, `.bind(...)`, `invoke(..., **kwargs)` or a
`configurable_fields` override; whichever is closest to the call wins. The engine itself is
resolved lazily here too, so constructing (or copying) a model never loads anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kev_engine import EMBEDDED_NAME, EngineLike, SamplingParams

from ..init_args import SETTING_KEYS, check_retries, check_sampling, hint, refuse_unknown, settings_model
from ..shared import resolve_engine
from ..tokens import text_token_ids

# the engine's sampling settings as fields (`kev_engine.SETTINGS`: types, bounds, descriptions), each
# None until set: None leaves it to the engine
KevSettings = settings_model("KevSettings", BaseModel)
# kwargs LangChain itself adds to calls; they carry no sampling meaning
IGNORED_KWARGS = frozenset({"ls_structured_output_format", "structured_output_format", "stream"})


class KevFields(KevSettings):  # type: ignore[misc, valid-type]  # a generated class
    """The fields both LangChain models share: engine identity, the sampling settings (generated,
    `KevSettings`), the adapter, a reply constraint and a timeout."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())

    model: str | None = None
    """Model source: a local folder, a .gguf file or a hub id; None = the embedded SmolLM2-135M-Instruct."""
    device: str | None = None
    """Torch device ("cpu", "cuda", ...); None picks CUDA when present."""
    dtype: str | None = None
    """Weights dtype ("float32", "bfloat16", ...); None = the loader's choice for the device."""
    adapters: dict[str, str] = Field(default_factory=dict)
    """LoRA adapters to load on first use, name → PEFT folder; requests pick one with `adapter`."""
    speculative: Literal["auto", "ngram", "model", "off"] | None = None
    """Speculative decoding of the engine this object builds (`Engine(speculative=...)`): drafts
    from each question's own text ("ngram") or from `draft_model` ("model") verified in the packed
    pass, the same tokens bit for bit; None = ``KEV_SPECULATIVE``, else "auto" (on where the engine
    is batch-invariant: "model" with a draft model, else "ngram")."""
    draft_model: str | None = None
    """A smaller model with the same tokenizer that drafts for the engine this object builds (a
    folder, .gguf file or hub id; `Engine(draft_model=...)`)."""
    engine: EngineLike | None = Field(default=None, exclude=True)
    """An already built engine (a `kev_engine.Engine`, or anything `EngineLike`) to use instead of the
    shared one (not serialized)."""
    base_url: str | None = None
    """A running ``kev serve`` (e.g. http://127.0.0.1:8000) to answer on instead of a local engine:
    the server's model and adapters; every setting and constraint travels with each call, and a
    `batch()` is one request (one pack on the server)."""
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    """The server's API key (with `base_url`)."""
    max_retries: int | None = None
    """With `base_url`: times a request is sent again after a connection error, 429 or 503, waiting
    as the server's Retry-After asks, else with exponential backoff (None or 0: never). Refused
    without `base_url`: in-process, nothing goes over a network."""
    adapter: str | None = None
    """LoRA adapter name for this call; None = the base model."""
    json_schema: dict[str, Any] | str | type | None = None
    """Constrain every reply to this JSON schema (a dict, its JSON text or a pydantic class)."""
    json_object: bool = False
    """Constrain every reply to one JSON object (OpenAI's JSON mode)."""
    regex: str | None = None
    """Constrain every reply to match this regular expression."""
    choice: list[str] | None = None
    """Constrain every reply to exactly one of these strings (a classifier)."""
    grammar: str | None = None
    """Constrain every reply to this EBNF grammar (xgrammar's GBNF dialect, rule ``root``)."""
    structural_tag: dict[str, Any] | str | None = None
    """Constrain every reply to this xgrammar structural tag (free text with constrained tagged
    regions); `bind_tools` sets one for the tool-call format. At most one constraint per call."""
    timeout: float | None = Field(default=None, gt=0)
    """Seconds to wait for an answer before cancelling it (TimeoutError); None = no limit."""

    @model_validator(mode="before")
    @classmethod
    def _kev_refuse_unknown_args(cls, values: Any) -> Any:
        """``ChatKev(num_predict=8)`` is a TypeError naming ``max_tokens``, not silently 256 tokens."""
        refuse_unknown(cls.__name__, values, cls.model_fields)
        return values

    @model_validator(mode="after")
    def _kev_check_sampling(self) -> Any:
        """What the fields' bounds cannot say (``min_tokens`` past ``max_tokens``, too many stop strings,
        two constraints) fails here, at construction, with the engine's own message."""
        check_sampling({key: getattr(self, key) for key in SETTING_KEYS if key != "adapter"})
        check_retries(self.max_retries, self.base_url)
        return self

    def get_engine(self) -> EngineLike:
        """The engine to run on: the one passed in, else a `kev serve` at `base_url`, else the shared
        one (loaded on first use)."""
        return resolve_engine(self.engine, self.model, self.device, self.dtype, self.adapters,
                              self.base_url, self.api_key, self.max_retries or 0, self.speculative,
                              self.draft_model)

    @property
    def model_name(self) -> str:
        """A name for tracing that never loads the model."""
        if self.engine is not None:
            return self.engine.name
        if self.base_url is not None:
            return f"kev serve at {self.base_url}"
        return self.model or EMBEDDED_NAME

    def get_token_ids(self, text: str) -> list[int]:
        """The ids of `text` from the model's own tokenizer (no chat template, no special tokens)."""
        custom = getattr(self, "custom_get_token_ids", None)
        if custom is not None:
            return list(custom(text))
        return text_token_ids(self.get_engine(), text)

    def settings_params(self) -> dict[str, Any]:
        """Fields that change an answer: part of the cache key and of the tracing params."""
        params: dict[str, Any] = {key: getattr(self, key) for key in SETTING_KEYS}
        params.update(model=self.model_name, device=self.device, dtype=self.dtype)
        return params

    def resolve(self, stop: list[str] | None, kwargs: Mapping[str, Any]) -> tuple[SamplingParams, str | None]:
        """Merge fields with per-call kwargs; an unknown kwarg is an error, not silently dropped."""
        unknown = sorted(set(kwargs) - set(SETTING_KEYS) - IGNORED_KWARGS)
        if unknown:
            hints = "".join(f" ({name}: {hint(name, SETTING_KEYS, 'a call')})" for name in unknown)
            raise TypeError(f"unknown Kev setting(s) {unknown}{hints}; allowed: {list(SETTING_KEYS)}")
        values = {key: getattr(self, key) for key in SETTING_KEYS}
        values.update({k: v for k, v in kwargs.items() if k in SETTING_KEYS})
        if stop is not None:  # an explicit `stop=` on the call beats the field
            values["stop"] = stop
        adapter = values.pop("adapter")
        return SamplingParams.from_dict(values), adapter  # None fields take the engine's defaults
