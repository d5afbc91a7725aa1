"""Who is asking, and whether they may ask now: Bearer keys, concurrency and token quotas.

Everything here runs before a request reaches an engine, and refuses at once (429 with a
Retry-After) rather than queueing: an unbounded line in front of the chip is how a server
falls over. Keys are stored only as SHA-256 hex digests, so a leaked config file leaks no
key. A presented key's digest is compared with every configured digest in constant time
(`hmac.compare_digest`, no early exit), so how long a refusal takes says nothing about how
close a guess came, nor which configured key it came close to.

With no tenants configured every request is the anonymous tenant, whatever Authorization
header it carries, so a local user can start the server and curl it at once (and the
official clients, which always send *some* key, work unchanged).

The token quota is a token bucket holding one minute's worth. Admission charges the
prompt plus max_tokens (what the request could cost); `Lease.release` refunds what it did
not generate. A request bigger than the whole bucket is admitted when the bucket is full
(and leaves it in debt), so a large request is slowed, never refused forever.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from config.settings import TenantConfig

from .errors import APIError, rate_limited

ANONYMOUS = TenantConfig(name="anonymous", api_key_sha256="0" * 64, share_prefix_cache=True)
# A concurrency refusal has no natural wait; this hint spreads the retries out.
CONCURRENCY_RETRY_S = 0.5


@dataclass
class TokenBucket:
    rate_per_s: float
    capacity: float
    clock: Callable[[], float] = time.monotonic
    level: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        self.level = self.capacity
        self.stamp = self.clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate_per_s)
        self.stamp = now

    def wait_s(self, cost: float) -> float:
        """Seconds until `cost` may be charged (0: now)."""
        self._refill()
        need = min(cost, self.capacity) - self.level
        return max(0.0, need / self.rate_per_s)

    def charge(self, cost: float) -> None:
        self._refill()
        self.level -= cost

    def refund(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)


@dataclass
class Tenant:
    config: TenantConfig
    in_flight: int = 0
    bucket: TokenBucket | None = None
    rejected: int = 0
    tokens: int = 0  # prompt + generated tokens of its ended requests (the console's rate)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def cache_salt(self) -> str:
        """Prefix-cache isolation: another tenant's cached prompt must not speed up (and so
        reveal itself to) this one unless the tenant opted into sharing."""
        return "" if self.config.share_prefix_cache else self.config.name

    def priority_for(self, requested: int | None) -> int:
        """A request may ask to be less urgent than its tenant's class, never more."""
        return max(self.config.priority, requested if requested is not None else 0)


class Lease:
    """A tenant's admission of one request; `release` (sync, idempotent) gives it back."""

    def __init__(self, tenant: Tenant, charged_tokens: int) -> None:
        self.tenant = tenant
        self.charged = charged_tokens
        self.released = False

    def release(self, used_tokens: int = 0) -> None:
        """`used_tokens`: prompt + generated tokens the request really cost (0 when it
        never reached an engine); the rest of the charge goes back to the bucket."""
        if self.released:
            return
        self.released = True
        self.tenant.in_flight -= 1
        self.tenant.tokens += used_tokens
        if self.tenant.bucket is not None:
            self.tenant.bucket.refund(max(0, self.charged - used_tokens))


def key_digest(key: str) -> bytes:
    """The SHA-256 digest of a presented key (configs hold its hex)."""
    return hashlib.sha256(key.encode()).digest()


def key_matches(key: str, digest_hex: str) -> bool:
    """Is `key` the one whose SHA-256 hex digest is `digest_hex`? In constant time."""
    return hmac.compare_digest(key_digest(key), bytes.fromhex(digest_hex))


class Tenants:
    def __init__(self, configs: list[TenantConfig], clock: Callable[[], float] = time.monotonic):
        self.by_digest = {c.api_key_sha256: Tenant(c, bucket=_bucket(c, clock)) for c in configs}
        self._digests = [(bytes.fromhex(d), t) for d, t in self.by_digest.items()]
        self.anonymous = Tenant(ANONYMOUS)

    @property
    def open(self) -> bool:
        return not self.by_digest

    def authenticate(self, authorization: str | None) -> Tenant:
        if self.open:
            return self.anonymous
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "Missing API key: send `Authorization: Bearer <key>`.",
                           type="authentication_error", code="missing_api_key")
        tenant = self.lookup(key)
        if tenant is None:
            raise APIError(401, "Incorrect API key provided.", type="authentication_error",
                           code="invalid_api_key")
        return tenant

    def lookup(self, key: str) -> Tenant | None:
        """The tenant whose key `key` is, or None. Every configured digest is compared, in
        constant time, whatever matched: the time taken depends only on how many there are."""
        digest = key_digest(key)
        found = None
        for configured, tenant in self._digests:
            if hmac.compare_digest(configured, digest):
                found = tenant
        return found

    def named(self, name: str) -> Tenant:
        """The tenant called `name` (a batch job's owner); the anonymous tenant when none
        is (tenants removed from the config since keep their batches running as it)."""
        for tenant in self.by_digest.values():
            if tenant.name == name:
                return tenant
        return self.anonymous

    def admit(self, tenant: Tenant, cost_tokens: int) -> Lease:
        """Take a concurrency slot and charge the token quota, or raise 429."""
        cfg = tenant.config
        if cfg.max_concurrency is not None and tenant.in_flight >= cfg.max_concurrency:
            tenant.rejected += 1
            raise rate_limited(
                f"Tenant `{cfg.name}` already has {tenant.in_flight} requests in flight "
                f"(limit {cfg.max_concurrency}).",
                CONCURRENCY_RETRY_S,
                code="tenant_concurrency",
            )
        if tenant.bucket is not None:
            wait = tenant.bucket.wait_s(cost_tokens)
            if wait > 0:
                tenant.rejected += 1
                raise rate_limited(
                    f"Tenant `{cfg.name}` is over its quota of {cfg.tokens_per_minute} "
                    f"tokens per minute (this request may use {cost_tokens}); retry in "
                    f"{math.ceil(wait * 1000)} ms.",
                    wait,
                    code="tenant_tokens_per_minute",
                )
            tenant.bucket.charge(cost_tokens)
        tenant.in_flight += 1
        return Lease(tenant, cost_tokens)


def _bucket(cfg: TenantConfig, clock: Callable[[], float]) -> TokenBucket | None:
    if cfg.tokens_per_minute is None:
        return None
    return TokenBucket(cfg.tokens_per_minute / 60.0, float(cfg.tokens_per_minute), clock)
