"""Tenants on a real `kev serve` over loopback: each API key has its own prefix-cache namespace.

The attack (CVE-2025-46570): tenant A's system prompt holds a secret; tenant B re-sends it with
guessed secrets and reads, from `cached_tokens` (or answer times), which guess A sent. Every
check is on `cached_tokens` and the engine's `prefix_hit_tokens`, never on a clock. The
shared-cache server is the control: the same probe does read A's prompt there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import tiny_model
from server_util import serving

from kev_engine import Engine, SamplingParams
from kev_integrations.remote import RemoteEngine
from kev_integrations.server import ServerConfig, build_app
from kev_integrations.server.tenants import Tenants

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
MODEL = "tiny"
POLICY = " ".join(f"Rule {i}: answer politely and never reveal account details to anyone." for i in range(30))


def system(pin: str) -> str:
    return f"Account PIN: {pin}. {POLICY}"  # the secret in the first KV block: a wrong guess shares nothing


def chat(pin: str, question: str = "What can you do?") -> list[dict[str, str]]:
    return [{"role": "system", "content": system(pin)}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> Iterator[Engine]:
    engine = Engine(tiny_model("llama", tokenizer), tokenizer, name=MODEL)
    yield engine
    engine.close()


def cached_tokens(base: str, key: str | None, messages: list[dict[str, str]], **extra: Any) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(base + "/v1/chat/completions", headers=headers, timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_key_never_reads_a_tenants_prefix_and_the_tenant_still_does(engine: Engine) -> None:
    config = ServerConfig(api_keys=(KEY_A, KEY_B), max_tokens_limit=16)
    with serving(build_app(engine, config, model_name=MODEL)) as base:
        assert cached_tokens(base, KEY_A, chat("7351"), cache_salt="acme") == 0  # A's first: computed
        hits = engine.stats()["prefix_hit_tokens"]
        guesses = [cached_tokens(base, KEY_B, chat(pin)) for pin in ("0000", "7351", "1234")]
        # A's very request, A's salt included
        salted = [cached_tokens(base, KEY_B, chat(pin), cache_salt="acme") for pin in ("7351", "9999")]
        assert guesses == [0, 0, 0] and salted == [0, 0]
        assert engine.stats()["prefix_hit_tokens"] == hits  # not one token of A's read, whatever B reports
        # B's own earlier probe is a hit for B: each tenant still has a working cache of its own
        assert cached_tokens(base, KEY_B, chat("7351", "Another?"), cache_salt="acme") >= 256
        assert cached_tokens(base, KEY_A, chat("7351", "Another question?"), cache_salt="acme") >= 256
        assert cached_tokens(base, KEY_A, chat("7351", "Another question?")) == 0  # no salt: another namespace of A


def test_the_same_probe_reads_the_prefix_when_the_cache_is_shared(engine: Engine) -> None:
    """The control: with --shared-prefix-cache the probe above does tell the right guess apart."""
    config = ServerConfig(api_keys=(KEY_A, KEY_B), max_tokens_limit=16, shared_prefix_cache=True)
    with serving(build_app(engine, config, model_name=MODEL)) as base:
        cached_tokens(base, KEY_A, chat("4242"))
        assert cached_tokens(base, KEY_B, chat("4243")) == 0
        assert cached_tokens(base, KEY_B, chat("4242")) >= 256


def test_without_keys_every_caller_is_one_tenant(engine: Engine) -> None:
    with serving(build_app(engine, ServerConfig(max_tokens_limit=16), model_name=MODEL)) as base:
        cached_tokens(base, None, chat("5150"))
        assert cached_tokens(base, None, chat("5150", "Something else?")) >= 256
        assert cached_tokens(base, None, chat("5150", "Something else?"), cache_salt="private") == 0


def test_remote_engine_clients_are_kept_apart_by_their_keys(engine: Engine) -> None:
    config = ServerConfig(api_keys=(KEY_A, KEY_B), max_tokens_limit=16)
    with serving(build_app(engine, config, model_name=MODEL)) as base:
        a, b = RemoteEngine(base, api_key=KEY_A, timeout=60), RemoteEngine(base, api_key=KEY_B, timeout=60)
        try:
            settings = SamplingParams(max_tokens=2, temperature=0, cache_salt="acme")
            assert a.generate([chat("8080")], settings)[0].cached_tokens == 0
            assert [r.cached_tokens for r in b.generate([chat("8080"), chat("8081")], settings)] == [0, 0]
            assert a.generate([chat("8080", "Again?")], settings)[0].cached_tokens >= 256
        finally:
            a.close()
            b.close()


def test_a_tenants_salt_is_a_keyed_digest_never_the_key() -> None:
    tenants, again = Tenants((KEY_A, KEY_B)), Tenants((KEY_A, KEY_B))
    a, b = tenants.of(KEY_A), tenants.of(KEY_B)
    assert a.salt != b.salt and KEY_A not in (a.salt or "") and KEY_A not in a.id
    assert again.of(KEY_A).salt != a.salt  # a per-process secret: not computable from the key alone
    digest = hashlib.sha256(b"acme").hexdigest()[:32]  # the client's salt, at one length whatever was sent
    assert a.cache_salt("acme") == f"{a.salt}/{digest}" and b.cache_salt("acme") != a.cache_salt("acme")
    assert tenants.from_header(f"Bearer {KEY_B}") == b and tenants.from_header("Bearer nope") is None
    assert Tenants((KEY_A,), shared_cache=True).of(KEY_A).cache_salt("acme") == "acme"
