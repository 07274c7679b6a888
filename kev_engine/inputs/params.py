"""Per-request sampling settings, the engine-wide defaults they fall back on, and `SETTINGS`: the
one declaration of the settings that the front ends' fields are generated from.

Where this sits: requests carry a `SamplingParams`; when a pack is formed the scheduler
resolves every `None` against one `Defaults` snapshot, so a hot update of the default
temperature never splits a pack (each pack keeps the settings version it started with).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import InvalidRequestError

MAX_CACHE_SALT = 256  # characters: a salt names a tenant or a user, it is not a payload

DEFAULT_TEMPERATURE = 0.0  # greedy: a QA engine should answer the same way twice
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily: logits / 1e-40 overflow to NaN
DEFAULT_MAX_TOKENS = 256
TEMPERATURE_ENV = "KEV_TEMPERATURE"
# what torch.Generator.manual_seed accepts (a negative seed wraps to 2**64 + seed)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
TOP_K_MAX = 2**63 - 1  # top_k travels to the sampler as an int64 tensor
# every decode step searches the new text for each stop string, on the scheduler thread that
# serves every request, and streaming holds back the longest one: bound what one request may ask
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 4096
MAX_N = 128  # samples of one prompt: each is a decode row of its own
MAX_TOP_LOGPROBS = 20  # OpenAI's limit; every logprobs row computes this many alternatives (see logprobs.py)
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100] (-100 bans a token in practice)
MAX_LOGIT_BIAS_TOKENS = 1024  # each biased token is an indexed write per decode step
MAX_STOP_TOKEN_IDS = 64


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_temperature(value: Any, where: str = "temperature") -> float:
    """Return `value` as a float, or raise naming it: temperature must be finite and >= 0."""
    if not _is_real(value) or math.isnan(value) or math.isinf(value) or value < 0:
        raise InvalidRequestError(f"{where}={value!r} is not allowed; use a finite number >= 0 (0 = greedy)")
    return float(value)


CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_CONSTRAINT_CHARS = 100_000  # compile time grows with size and nesting: bound what one request may ask
MAX_SCHEMA_DEPTH = 32


def _pydantic_schema(value: Any) -> dict[str, Any] | None:
    """A pydantic model class's JSON schema, or None if `value` is not one."""
    schema = getattr(value, "model_json_schema", None)
    return schema() if isinstance(value, type) and callable(schema) else None


def _schema_text(value: Any, name: str, convert: Any = None) -> str:
    """A JSON object given as dict, JSON text (or a pydantic class) → compact JSON text."""
    converted = convert(value) if convert is not None else None
    if converted is not None:
        value = converted
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidRequestError(f"{name} is not valid JSON ({exc}): {value[:200]!r}") from None
    if not isinstance(value, dict):
        allowed = "a dict, its JSON text or a pydantic model class" if convert else "a dict or its JSON text"
        raise InvalidRequestError(f"{name}={value!r} is not allowed; use {allowed}")
    if _depth(value) > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"{name} nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten it")
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{name} cannot be written as JSON: {exc}") from None


def _depth(value: Any) -> int:
    """How deeply dicts and lists nest in `value` (iterative: a hostile schema cannot overflow the stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, level = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            if level <= MAX_SCHEMA_DEPTH:
                todo.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _check_stop(value: Any) -> tuple[str, ...]:
    """Stop strings as a tuple, within `MAX_STOP_STRINGS` strings and `MAX_STOP_CHARS` characters."""
    stop = (value,) if isinstance(value, str) else value
    if isinstance(stop, (list, tuple)) and len(stop) > MAX_STOP_STRINGS:  # first: never echo 5,000 of them
        raise InvalidRequestError(
            f"stop=[{len(stop)} strings] is not allowed; give at most {MAX_STOP_STRINGS} stop strings"
        )
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequestError(f"stop={value!r} is not allowed; use a non-empty string or a list of them")
    chars = sum(len(s) for s in stop)
    if chars > MAX_STOP_CHARS:
        raise InvalidRequestError(
            f"stop=[{chars} characters in all] is not allowed; the stop strings may total at most "
            f"{MAX_STOP_CHARS} characters"
        )
    return tuple(stop)


def _check_real(name: str, value: Any, low: float, high: float, allowed: str) -> float:
    """`value` as a float within [low, high], or raise naming it and the allowed range."""
    if not _is_real(value) or math.isnan(value) or not low <= value <= high:
        raise InvalidRequestError(f"{name}={value!r} is not allowed; use {allowed}")
    return float(value)


def _check_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or decimal strings, as JSON sends them) or (id, bias) pairs →
    pairs sorted by id: one canonical, hashable form whatever the input."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise InvalidRequestError(
            f"logit_bias={value!r} is not allowed; use a dict of token id -> bias in [-100, 100]"
        )
    if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError(
            f"logit_bias=[{len(pairs)} tokens] is not allowed; bias at most {MAX_LOGIT_BIAS_TOKENS} tokens"
        )
    biases: dict[int, float] = {}
    for token, bias in pairs:
        token_id = int(token) if isinstance(token, str) and token.isdecimal() else token
        if not _is_int(token_id) or token_id < 0:
            raise InvalidRequestError(f"logit_bias key {token!r} is not allowed; use a token id (an integer >= 0)")
        if token_id in biases:
            raise InvalidRequestError(f"logit_bias names token {token_id} twice")
        biases[token_id] = _check_real(f"logit_bias[{token_id}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS,
                                       "a number in [-100, 100]")
    return tuple(sorted(biases.items()))


def _check_token_ids(name: str, value: Any, limit: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in value):
        raise InvalidRequestError(f"{name}={value!r} is not allowed; use a list of token ids (integers >= 0)")
    if len(value) > limit:
        raise InvalidRequestError(f"{name}=[{len(value)} ids] is not allowed; give at most {limit}")
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one question is sampled. `temperature=None` takes the engine's default when the question
    is queued (its group keeps that settings version)."""

    temperature: float | None = None
    """0 = greedy (so is anything below ``GREEDY_BELOW`` = 1e-5); None = the engine default
    (``KEV_TEMPERATURE``, else 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables it. At most 2**63 - 1."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    """Most new tokens to generate (the model's context may end the answer earlier)."""
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Strings that end the answer; the text is cut before the first one found. At most
    ``MAX_STOP_STRINGS`` (32) of them, ``MAX_STOP_CHARS`` (4096) characters in all."""
    seed: int | None = None
    """A seeded request samples the same tokens whatever it is packed with; -2**63 .. 2**64 - 1."""
    cache_salt: str | None = None
    """Requests with different salts never share prefix KV or compiled grammars: give each tenant
    its own, since a shared cache is a timing side channel between them (vLLM, CVE-2025-46570).
    `kev serve` puts each API key in a namespace of its own; this salt subdivides it."""

    # ---- more of OpenAI's and vLLM's sampling settings (all per question, mixed in one pack) ----
    n: int = 1
    """Samples of this prompt, 1..128: its prompt is computed once and every sample decodes from it.
    The prompt's result is then its first sample, with all n in ``Completion.samples``; with a
    seed, sample i draws with a seed derived from (seed, i), sample 0 with the seed itself."""
    logprobs: bool = False
    """Report each generated token's log-probability (``Completion.logprobs``, streamed pieces)."""
    top_logprobs: int = 0
    """With logprobs: also the most likely alternatives at each step, 0..20."""
    presence_penalty: float = 0.0
    """OpenAI's: subtract this from the logit of every token already generated in this answer; [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtract this times the token's count so far in this answer; [-2, 2]."""
    repetition_penalty: float = 1.0
    """transformers' (CTRL): a token seen in the prompt or the answer has its logit divided by this
    (multiplied when negative); > 0, 1 = off, above 1 discourages repeats."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; [0, 1], 0 = off."""
    logit_bias: Any = ()
    """Token id -> bias added to its logit, in [-100, 100] (-100 bans it in practice). A dict
    (ids as ints or decimal strings) or (id, bias) pairs; stored as pairs sorted by id."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Token ids that end the answer as end-of-sequence does (kept in token_ids, not in the text)."""
    min_tokens: int = 0
    """No end-of-sequence, stop token or stop string ends the answer before this many tokens."""
    ignore_eos: bool = False
    """End-of-sequence does not end the answer (fixed lengths for benchmarks); a constrained
    answer still ends where its grammar does."""

    # ---- a constraint on the reply (at most one; the reply then matches it by construction) ----
    json_schema: Any = None
    """A JSON schema the reply must satisfy: a dict, its JSON text, or a pydantic model class.
    Stored as compact JSON text, properties in the order given (they are generated in it)."""
    json_object: bool = False
    """The reply is any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
    regex: str | None = None
    """A regular expression the whole reply must match."""
    choice: tuple[str, ...] | None = None
    """The reply is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's dialect of GBNF, rule ``root``) the reply must match."""
    structural_tag: Any = None
    """An xgrammar structural tag (dict or JSON text): free text with constrained tagged regions,
    e.g. tool calls. Stored as compact JSON text."""

    def __post_init__(self) -> None:
        if self.temperature is not None:
            object.__setattr__(self, "temperature", check_temperature(self.temperature))
        if not _is_real(self.top_p) or math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p={self.top_p!r} is not allowed; use a number in (0, 1]")
        object.__setattr__(self, "top_p", float(self.top_p))
        if not _is_int(self.top_k) or not 0 <= self.top_k <= TOP_K_MAX:
            raise InvalidRequestError(
                f"top_k={self.top_k!r} is not allowed; use an integer in [0, 2**63 - 1] (0 = off)"
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens={self.max_tokens!r} is not allowed; use an integer >= 1")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(
                f"seed={self.seed!r} is not allowed; use None or an integer in [-2**63, 2**64 - 1]"
            )
        object.__setattr__(self, "stop", _check_stop(self.stop))
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidRequestError(
                f"cache_salt={self.cache_salt!r} is not allowed; use a non-empty string or None"
            )
        if self.cache_salt is not None and len(self.cache_salt) > MAX_CACHE_SALT:
            raise InvalidRequestError(  # hashed with every request's blocks: a megabyte would cost every pass
                f"cache_salt is {len(self.cache_salt)} characters; at most {MAX_CACHE_SALT} are allowed"
            )
        self._check_more()
        self._check_constraint()

    def _check_more(self) -> None:
        """The settings beyond temperature/top-p/top-k, each checked and stored in canonical form."""
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n={self.n!r} is not allowed; use an integer in [1, {MAX_N}]")
        if not isinstance(self.logprobs, bool):
            raise InvalidRequestError(f"logprobs={self.logprobs!r} is not allowed; use True or False")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs={self.top_logprobs!r} is not allowed; use an integer in [0, {MAX_TOP_LOGPROBS}]"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError(f"top_logprobs={self.top_logprobs} needs logprobs=True")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_real(name, getattr(self, name), -MAX_PENALTY, MAX_PENALTY, "a number in [-2, 2]")
            object.__setattr__(self, name, value)
        repetition = self.repetition_penalty
        if not _is_real(repetition) or not 0 < repetition < math.inf:
            raise InvalidRequestError(
                f"repetition_penalty={repetition!r} is not allowed; use a finite number > 0 (1 = off)"
            )
        object.__setattr__(self, "repetition_penalty", float(repetition))
        object.__setattr__(self, "min_p", _check_real("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1]"))
        object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))
        object.__setattr__(self, "stop_token_ids",
                           _check_token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens={self.min_tokens!r} is not allowed; use an integer in [0, max_tokens={self.max_tokens}]"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos={self.ignore_eos!r} is not allowed; use True or False")

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes this request's logits (`penalties` then works on its row)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def _check_constraint(self) -> None:
        """At most one constraint, each in its canonical form (the grammar cache's key)."""
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) > 1:
            raise InvalidRequestError(f"give at most one of {list(CONSTRAINT_FIELDS)}; got {given}")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema, "json_schema", _pydantic_schema))
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag", _schema_text(self.structural_tag, "structural_tag"))
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(f"json_object={self.json_object!r} is not allowed; use True or False")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name}={value!r} is not allowed; use a non-empty string or None")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequestError(
                    f"choice={choice!r} is not allowed; use a non-empty list of non-empty strings"
                )
            object.__setattr__(self, "choice", tuple(choice))
        constraint = self.constraint
        if constraint is not None and len(constraint[1]) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(
                f"the {constraint[0]} constraint is {len(constraint[1])} characters; at most {MAX_CONSTRAINT_CHARS}",
                param=constraint[0],
            )

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, canonical text) of this request's constraint, or None: the grammar cache key."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is True:
                return (name, "")
            if isinstance(value, tuple):
                return (name, json.dumps(value, ensure_ascii=False))
            if value not in (None, False):
                return (name, value)
        return None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Build from a mapping, naming any unknown key and the allowed ones."""
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise InvalidRequestError(f"unknown sampling setting(s) {unknown}; allowed: {allowed}")
        cleaned = {k: v for k, v in values.items() if v is not None or k in ("temperature", "seed")}
        for key, fallback in (("top_p", 1.0), ("top_k", 0)):
            if key in values and values[key] is None:
                cleaned[key] = fallback
        return cls(**cleaned)

    def with_defaults(self, defaults: Defaults) -> SamplingParams:
        """Resolve the settings left to the engine (today: temperature)."""
        if self.temperature is not None:
            return self
        return replace(self, temperature=defaults.temperature)


def coerce_sampling(value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    """Accept a `SamplingParams`, a dict of its fields, or None (all defaults)."""
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        return SamplingParams.from_dict(value)
    raise InvalidRequestError(f"sampling={value!r} is not allowed; use SamplingParams, a dict of its fields, or None")


SETTING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams) if f.name not in CONSTRAINT_FIELDS)
"""Every sampling setting that is not a reply constraint, in declaration order: the one list the
front ends (LangChain, LlamaIndex, kev serve, Ray Data) take their setting names from."""
INT_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.type in ("int", "int | None"))
"""The integer settings (a column of them with gaps arrives as floats)."""

_DEFAULT_PARAMS = SamplingParams()  # every setting at its default


@dataclass(frozen=True)
class Setting:
    """One sampling setting as a front end offers it (a LangChain or LlamaIndex field): the type of a
    value, the bounds `SamplingParams` checks, one line of description; the default is the dataclass's."""

    name: str
    annotation: Any
    """The type of a value; a front end may add None, meaning "the engine's default"."""
    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    @property
    def default(self) -> Any:
        """`SamplingParams`' default, in its canonical form (``stop`` is ``()``)."""
        return getattr(_DEFAULT_PARAMS, self.name)

    @property
    def bounds(self) -> dict[str, float]:
        """The bounds that apply, by the names pydantic's ``Field`` takes them."""
        return {key: value for key in ("ge", "gt", "le") if (value := getattr(self, key)) is not None}


SETTINGS: tuple[Setting, ...] = (
    Setting("temperature", float, "0 = greedy; None = the engine's default (KEV_TEMPERATURE, else 0).", ge=0),
    Setting("top_p", float, "Nucleus sampling: keep the likeliest tokens up to this probability mass; 1 = off.",
            gt=0, le=1),
    Setting("top_k", int, "Keep the k likeliest tokens; 0 = off.", ge=0, le=TOP_K_MAX),
    Setting("max_tokens", int, "Most new tokens per answer (the model's context may end it earlier).", ge=1),
    Setting("stop", list[str], "Strings that end an answer; the text is cut before the first one."),
    Setting("seed", int, "Seeded sampling: the same tokens whatever the question is packed with.",
            ge=SEED_MIN, le=SEED_MAX),
    Setting("cache_salt", str, "Calls with different salts never share prefix KV: give each tenant its own."),
    Setting("n", int, "Samples of each prompt, all decoded from one prefill.", ge=1, le=MAX_N),
    Setting("logprobs", bool, "Report each generated token's log-probability."),
    Setting("top_logprobs", int, "With logprobs: the likeliest alternatives at each token too.",
            ge=0, le=MAX_TOP_LOGPROBS),
    Setting("presence_penalty", float, "OpenAI's: lower the logit of every token already in the answer by this.",
            ge=-MAX_PENALTY, le=MAX_PENALTY),
    Setting("frequency_penalty", float, "OpenAI's: lower a token's logit by this times its count in the answer.",
            ge=-MAX_PENALTY, le=MAX_PENALTY),
    Setting("repetition_penalty", float,
            "transformers': divide the logit of tokens seen in the prompt or the answer by this; 1 = off.", gt=0),
    Setting("min_p", float, "Drop tokens less likely than min_p times the likeliest one; 0 = off.", ge=0, le=1),
    Setting("logit_bias", dict[int | str, float],
            "Token id -> bias added to its logit, in [-100, 100] (-100 bans the token)."),
    Setting("stop_token_ids", list[int], "Token ids that end an answer as end-of-sequence does."),
    Setting("min_tokens", int, "Nothing but max_tokens ends an answer before it has this many tokens.", ge=0),
    Setting("ignore_eos", bool, "End-of-sequence does not end an answer (fixed lengths, for benchmarks)."),
)
"""Every sampling setting that is not a reply constraint, as the front ends declare it: LangChain's
and LlamaIndex's fields are generated from this table, so their types, bounds and descriptions are
the engine's. `SamplingParams` still checks every value, past what bounds can say; its checks and
these bounds meet at the same edges (tests/test_sampling_settings.py)."""
assert tuple(s.name for s in SETTINGS) == SETTING_FIELDS, "SETTINGS declares each of SETTING_FIELDS once, in order"


@dataclass(frozen=True)
class Defaults:
    """Engine-wide defaults; `version` grows by one with every update."""

    temperature: float = DEFAULT_TEMPERATURE
    version: int = 0

    @classmethod
    def from_env(cls) -> Defaults:
        """Read ``KEV_TEMPERATURE`` once at start-up; a bad value is an error, not ignored."""
        raw = os.environ.get(TEMPERATURE_ENV)
        if raw is None or raw.strip() == "":
            return cls()
        try:
            value = float(raw)
        except ValueError:
            raise InvalidRequestError(
                f"{TEMPERATURE_ENV}={raw!r} is not a number; use a finite number >= 0"
            ) from None
        return cls(temperature=check_temperature(value, TEMPERATURE_ENV))
