"""Who is calling: each API key is a tenant, with its own namespace in the prefix cache.

Why: a prefix cache shared between callers is a side channel (CVE-2025-46570; "Leaking Secrets
from Prefix Caches", arXiv 2411.18191). A caller who re-sends another's prompt with guessed
variants learns, from `usage.prompt_tokens_details.cached_tokens` or from how fast the answer
comes, which guess the other sent. vLLM's `cache_salt` is chosen by the client, so a client can
also pick another tenant's salt. Here the server derives the salt from the authenticated key —
HMAC-SHA256 with a secret drawn at random when the app is built, so the salt never contains the
key, cannot be computed by a client and changes with every process — and a client's own
`cache_salt` only subdivides its tenant's namespace: ``<tenant salt>/<client salt>``.

With no API keys configured every caller is the same tenant (the server cannot tell them
apart): the client's `cache_salt` is used as sent. `shared=True` (``kev serve
--shared-prefix-cache``) gives every key one cache again, as the operator's explicit choice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from fastapi import Request

from kev_engine import SamplingParams

from .errors import APIError

SALT_PREFIX = "kev-tenant-"


@dataclass(frozen=True)
class Tenant:
    """One caller as the server tells them apart."""

    id: str
    """A per-process pseudonym of the key (never the key): the bucket of per-key limits; '' with no keys."""
    salt: str | None
    """The prefix-cache namespace of this tenant; None = the client's `cache_salt` as sent."""

    def cache_salt(self, client_salt: str | None) -> str | None:
        """The salt the engine sees: the tenant's namespace, subdivided by the client's own salt."""
        if self.salt is None:
            return client_salt
        if client_salt is None:
            return self.salt
        return f"{self.salt}/{hashlib.sha256(client_salt.encode()).hexdigest()[:32]}"  # one length, whatever was sent

    def scoped(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with its cache salt moved into this tenant's namespace."""
        salt = self.cache_salt(sampling.cache_salt)
        return sampling if salt == sampling.cache_salt else dataclasses.replace(sampling, cache_salt=salt)


ONE_TENANT = Tenant("", None)  # no keys configured: everyone


class Tenants:
    """The tenant of each configured API key (HMAC pseudonyms computed once, at start)."""

    def __init__(self, api_keys: tuple[str, ...], shared_cache: bool = False) -> None:
        secret = secrets.token_bytes(32)  # per process: salts never outlive it or leave it
        self.keys = api_keys
        self.shared_cache = shared_cache
        self._by_key: dict[str, Tenant] = {}
        for key in api_keys:
            digest = hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:32]
            self._by_key[key] = Tenant(digest, None if shared_cache else SALT_PREFIX + digest)

    def of(self, key: str | None) -> Tenant:
        """The tenant of an accepted key (`check_key`'s answer); None (no keys configured) = everyone."""
        if key is None:
            return ONE_TENANT
        return self._by_key[key]

    def from_header(self, authorization: str) -> Tenant | None:
        """The tenant an ``Authorization`` header names; None for a missing or wrong key (a 401 to come)."""
        if not self.keys:
            return ONE_TENANT
        key = matching_key(authorization, self.keys)
        return None if key is None else self._by_key[key]


def matching_key(authorization: str, keys: tuple[str, ...]) -> str | None:
    """The configured key a ``Bearer <key>`` header carries, compared in constant time; else None."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    found = None
    for key in keys:  # every key compared: the time taken does not say which one matched
        if hmac.compare_digest(token.encode(), key.encode()):
            found = key
    return found


def check_key(request: Request, keys: tuple[str, ...], what: str) -> str | None:
    """The configured key `request` carries (None when the server has no keys), else a 401."""
    if not keys:
        return None
    key = matching_key(request.headers.get("authorization", ""), keys)
    if key is None:
        raise APIError(401, f"missing or wrong API key for {what}; send 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key")
    return key
