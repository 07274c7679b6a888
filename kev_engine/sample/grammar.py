"""Constrained decoding: a grammar per request, applied as a token bitmask before sampling.

Where this sits: a request's constraint (`SamplingParams.constraint`) is compiled on the
caller's thread when it is submitted — once per distinct constraint and `cache_salt`, then from
an LRU cache bounded in bytes — so an invalid schema fails that request alone and the scheduler
thread never compiles. A server compiles ahead in a pool of its own (`Engine.compile_grammar`),
so that submitting finds the grammar cached. Each
request gets its own `xgrammar.GrammarMatcher`; at sampling, only the constrained rows of the
pass fill a bitmask and have it applied to their logits (xgrammar's CPU or CUDA kernel), so
free questions pay nothing and greedy and random sampling both see only allowed tokens. The
matcher then accepts the sampled token. Once the grammar is complete it allows only the
model's end-of-sequence tokens, so a constrained reply ends where its grammar does.

xgrammar (used by vLLM and SGLang) handles JSON schema, regex, EBNF and structural tags
(free text with constrained tagged regions — tool calls) over any HF tokenizer.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

import torch

from ..errors import ConstraintError

MAX_CACHED_GRAMMAR_BYTES = 256 * 2**20  # a 2,000-property schema compiles to ~11 MiB
UNSIZED_GRAMMAR_BYTES = 2**20  # what a grammar counts when xgrammar cannot say its size
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[13:21:28] /project/cpp/x.cc:4944: "


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # a dependency of kev-llm; only a broken install lands here
        raise ConstraintError(
            "constrained decoding needs the xgrammar package (a dependency of kev-llm): pip install xgrammar"
        ) from exc
    return xgrammar


CacheKey = tuple[str | None, str, str]  # (cache_salt, kind, canonical text)


def _choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for 'exactly one of these strings' (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """One engine's grammar compiler: constraints in, compiled grammars (cached) and matchers out.

    Built lazily on the first constrained request: reading the vocabulary takes a few hundred
    milliseconds, which free-text users should never pay. The cache is keyed by the request's
    `cache_salt` too: whether a constraint compiles at once or takes seconds says whether someone
    used it before, so tenants apart in the prefix cache are apart here as well. It holds at most
    `max_bytes` of compiled grammars (xgrammar's own size of each), least recently used first out.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Collection[int],
                 max_bytes: int = MAX_CACHED_GRAMMAR_BYTES) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = sorted(stop_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[CacheKey, tuple[Any, int]] = OrderedDict()  # key → (compiled, its bytes)
        self.max_bytes = max_bytes
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self.compiles = 0
        self.cache_hits = 0

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids
            )
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # our LRU is the cache
        return self._compiler

    def is_cached(self, constraint: tuple[str, str], salt: str | None = None) -> bool:
        """Whether `compile` would answer from the cache (counts as nothing)."""
        with self._lock:
            return (salt, *constraint) in self._cache

    def compile(self, constraint: tuple[str, str], salt: str | None = None) -> Any:
        """The compiled grammar of (kind, canonical text) for `salt`'s requests; a bad one raises
        `ConstraintError`."""
        key: CacheKey = (salt, *constraint)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return entry[0]
            compiler = self._get_compiler()
        compiled = self._compile(compiler, *constraint)  # outside the lock: others may hit the cache
        self._check_satisfiable(compiled, constraint)
        size = getattr(compiled, "memory_size_bytes", None)
        size = size if isinstance(size, int) else UNSIZED_GRAMMAR_BYTES
        with self._lock:
            if key not in self._cache:  # another thread may have compiled it meanwhile
                self._cache[key] = (compiled, size)
                self.cached_bytes += size
            self.compiles += 1
            while self.cached_bytes > self.max_bytes and len(self._cache) > 1:  # the newest stays, even alone
                _, (_, freed) = self._cache.popitem(last=False)
                self.cached_bytes -= freed
        return compiled

    @staticmethod
    def _compile(compiler: Any, kind: str, text: str) -> Any:
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":  # an object, as OpenAI's json_object mode promises (not any JSON value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(json.loads(text)))
            if kind == "grammar":
                return compiler.compile_grammar(text)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(text)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's own parse/convert errors
            lines = str(exc).strip().splitlines()
            message = _XGRAMMAR_LOCATION.sub("", lines[-1]) if lines else type(exc).__name__
            raise ConstraintError(
                f"{kind} could not be compiled: {message}; the constraint was {text[:300]!r}", param=kind
            ) from exc
        raise ConstraintError(f"unknown constraint kind {kind!r}")

    def _check_satisfiable(self, compiled: Any, constraint: tuple[str, str]) -> None:
        """A grammar whose first token can be nothing at all is refused now, not as an empty reply."""
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            kind, text = constraint
            raise ConstraintError(f"{kind} allows no reply at all (no token can start it): {text[:300]!r}",
                                  param=kind)

    def matcher(self, compiled: Any) -> Any:
        return _xgrammar().GrammarMatcher(compiled)


def mask_logits(logits: torch.Tensor, matchers: Sequence[Any], vocab_size: int) -> list[int]:
    """Mask, in place, each row of `logits` [N, V] whose matcher is not None to its allowed tokens.

    Returns the rows whose grammar allows no token at all (their request must fail: sampling
    would pick a token the grammar refuses). Unconstrained rows are not touched.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return []
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(logits), vocab_size)
    for row in rows:
        matchers[row].fill_next_token_bitmask(bitmask, row)
    dead = [row for row in rows if not bool(bitmask[row].any())]
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
    return dead
