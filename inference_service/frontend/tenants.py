"""Tenants: who sent a request (from the trusted side only), what they may see, and their quotas.

Tenant configuration is any of `--tenants-file`, `--trusted-tenant-header`, `--tls-client-ca`. With
none, every request is the one anonymous tenant, without limits (a single-user server). With any, a
request's tenant comes from:
1. `Authorization: Bearer <token>` (gRPC metadata or HTTP header): the admin token names the admin
   principal (sees everything); a token of the tenants file names its tenant. Any other token, or an
   Authorization value that is not `Bearer <token>`, is UNAUTHENTICATED (HTTP 401) on every route.
   A token decides even when the trusted header is there too (the header is then ignored).
2. The operator's trusted header: only a tenant whose entry says `via_trusted_header: true`; a
   header naming any other (or no) tenant is UNAUTHENTICATED. It is never an admin. The port must
   then be reachable only through the gateway that sets it.
3. The mTLS client certificate's subject common name: the tenant whose `mtls_common_name` (or
   name) it is, else a tenant of that name with no limits (the CA vouched for it).
4. Nothing: the tenant declared by the entry `{name: anonymous, anonymous: true, ...limits}`, with
   its own limits like any other; without that entry, UNAUTHENTICATED (HTTP 401).
A repeated Authorization or trusted header is UNAUTHENTICATED: which value counts would be a guess.

Adapters: each tenant has its own namespace (frontend/namespace.py), sources and max_adapters
(frontend/tenant_adapters.py).

Quotas (per tenant, from the tenants file): `max_running + max_queued` requests in flight, where
each of a request's n samples counts as one, and `tokens_per_minute`, a token bucket that refills
continuously and holds a minute's worth: a request reserves prompt + max_new_tokens per sample at
admission and the unused part of its reservation is refunded when it ends. A request over a quota
now is RESOURCE_EXHAUSTED (HTTP 429) with a retry hint (`QuotaExceeded.retry_after_s`); one that can
never fit (n above the in-flight cap, a reservation above tokens_per_minute) is INVALID_ARGUMENT
(HTTP 400), and a tenant whose cap is 0 gets PERMISSION_DENIED (HTTP 403): no retry would pass.
The limits never touch other tenants' requests.

Prefix cache: per tenant by default whenever tenants are configured (ServerConfig.cache_scope);
tenants whose entries share a `cache_group` share cached prompts (`tenant_identity`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from adapter_cache.errors import (
    InvalidArgumentError,
    LoraplexError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from adapter_cache.uri_policy import UriPolicy
from inference_service.engine.request import TenantTag

ANONYMOUS = "anonymous"  # every request without a credential
ADMIN = "admin"  # the admin token's principal
OTHER = "other"  # the metric label of tenants outside the top-K
RESERVED_NAMES = (ANONYMOUS, ADMIN, OTHER)
MAX_TENANTS = 10_000
MAX_TRACKED = 10_000  # tenants whose counts are kept one by one (the rest: `other`)
_FIELDS = {"name", "token_sha256", "token_file", "admin", "max_running", "max_queued", "tokens_per_minute",
           "weight", "mtls_common_name", "min_priority", "anonymous", "via_trusted_header", "cache_group",
           "sources", "max_adapters", "adapter_pool_bytes"}


@dataclass(frozen=True)
class TenantSpec:
    """One entry of --tenants-file."""

    name: str
    token_sha256: bytes | None = None  # the token's SHA-256 digest; the token itself is never kept
    admin: bool = False
    max_running: int | None = None
    max_queued: int | None = None
    tokens_per_minute: int | None = None
    weight: float = 1.0
    mtls_common_name: str | None = None
    min_priority: int = 0  # the lowest (most urgent) request priority this tenant may ask for
    anonymous: bool = False  # the tenant of requests without a credential (name `anonymous`)
    via_trusted_header: bool = False  # the operator's trusted header may name this tenant
    cache_group: str | None = None  # tenants of one group share prefix-cached KV (None: its own)
    sources: tuple[str, ...] = ()  # URI prefixes it may load adapters from (inside the allow-list); none: nothing
    max_adapters: int | None = None  # adapters it may have registered at once
    # Bytes of the engine's adapter pool it is entitled to: its loads evict its own idle adapters first
    # once it holds them, and no other tenant evicts its adapters while it is within them (lora/pool_shares.py)
    adapter_pool_bytes: int | None = None

    @property
    def max_in_flight(self) -> int | None:
        if self.max_running is None and self.max_queued is None:
            return None
        return (self.max_running or 0) + (self.max_queued or 0)


@dataclass(frozen=True)
class Tenant:
    """A request's principal."""

    name: str
    admin: bool = False
    spec: TenantSpec | None = None  # its limits; None: none
    from_token: bool = False  # named by a bearer token of the tenants file

    @property
    def tag(self) -> TenantTag:
        if self.spec is None:
            return TenantTag(self.name)
        return TenantTag(self.name, self.spec.weight, self.spec.max_running)


ADMIN_TENANT = Tenant(ADMIN, admin=True)


def tenant_identity(tenant: Tenant) -> str | None:
    """The prefix-cache identity (frontend/cache_salt.py, scope `identity`) of a tenant: its
    tenants-file `cache_group` when it has one (the operator's choice to share), else its name,
    each typed so a group can never be spelled as a tenant; None for the anonymous tenant (which
    keeps its listener's namespace, apart from every named tenant's)."""
    if tenant.name == ANONYMOUS:
        return None
    group = tenant.spec.cache_group if tenant.spec is not None else None
    return f"group:{group}" if group is not None else f"tenant:{tenant.name}"


def _int(entry: Mapping[str, object], key: str, where: str) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: {key} must be a non-negative integer")
    return value


def _sources(entry: Mapping[str, object], where: str) -> tuple[str, ...]:
    """A tenant's adapter sources: URI prefixes, checked as the allow-list's (adapter_cache/uri_policy.py)."""
    value = entry.get("sources", [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where}: sources must be a list of URI prefixes")
    try:
        UriPolicy(value)
    except LoraplexError as e:
        raise ValueError(f"{where}: sources: {e}") from None
    return tuple(value)


def parse_tenants(data: object, base_dir: str = ".") -> tuple[TenantSpec, ...]:
    """`{tenants: [{name, ...the fields of _FIELDS}]}` → specs (TenantSpec says what each means; at most
    one entry `{name: anonymous, anonymous: true, ...limits}`, with no credential); ValueError on
    anything else."""
    import os

    if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], list):
        raise ValueError("tenants file: expected {tenants: [...]}")
    specs: list[TenantSpec] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for i, entry in enumerate(data["tenants"]):
        where = f"tenants file entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping")
        unknown = set(entry) - _FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name or len(name) > 128 or not name.isprintable():
            raise ValueError(f"{where}: name must be a printable string of 1-128 characters")
        anonymous = entry.get("anonymous", False)
        if not isinstance(anonymous, bool):
            raise ValueError(f"{where}: anonymous must be true or false")
        if anonymous and name != ANONYMOUS:
            raise ValueError(f"{where}: the anonymous tenant is named {ANONYMOUS!r}")
        if anonymous and set(entry) & {"token_sha256", "token_file", "mtls_common_name", "via_trusted_header", "admin"}:
            raise ValueError(f"{where}: the anonymous tenant has no credential and is no admin")
        if name == ANONYMOUS and not anonymous:
            raise ValueError(f"{where}: {ANONYMOUS!r} is reserved: declare the tenant of requests without a "
                             "credential with `anonymous: true`")
        if (name in RESERVED_NAMES and not anonymous) or name in names:
            raise ValueError(f"{where}: tenant name {name!r} is reserved or repeated")
        names.add(name)
        digest: bytes | None = None
        if "token_sha256" in entry and "token_file" in entry:
            raise ValueError(f"{where}: give token_sha256 or token_file, not both")
        if "token_sha256" in entry:
            hexed = entry["token_sha256"]
            if not isinstance(hexed, str) or len(hexed) != 64:
                raise ValueError(f"{where}: token_sha256 must be 64 hex digits")
            try:
                digest = bytes.fromhex(hexed)
            except ValueError:
                raise ValueError(f"{where}: token_sha256 must be 64 hex digits") from None
        elif "token_file" in entry:
            path = entry["token_file"]
            if not isinstance(path, str):
                raise ValueError(f"{where}: token_file must be a path")
            with open(os.path.join(base_dir, path), encoding="utf-8") as f:
                token = f.read().strip()
            if not token:
                raise ValueError(f"{where}: token file {path} is empty")
            digest = hashlib.sha256(token.encode()).digest()
        if digest is not None:
            if digest in digests:
                raise ValueError(f"{where}: the same token names two tenants")
            digests.add(digest)
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"{where}: admin must be true or false")
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 < weight < math.inf:
            raise ValueError(f"{where}: weight must be a positive number")
        cn = entry.get("mtls_common_name")
        if cn is not None and not isinstance(cn, str):
            raise ValueError(f"{where}: mtls_common_name must be a string")
        min_priority = entry.get("min_priority", 0)
        if not isinstance(min_priority, int) or isinstance(min_priority, bool) or abs(min_priority) > 2**31 - 1:
            raise ValueError(f"{where}: min_priority must be an int32")
        via_header = entry.get("via_trusted_header", False)
        if not isinstance(via_header, bool):
            raise ValueError(f"{where}: via_trusted_header must be true or false")
        group = entry.get("cache_group")
        if group is not None and (not isinstance(group, str) or not group or len(group) > 128):
            raise ValueError(f"{where}: cache_group must be a string of 1-128 characters")
        specs.append(TenantSpec(name, digest, admin, _int(entry, "max_running", where),
                                _int(entry, "max_queued", where), _int(entry, "tokens_per_minute", where),
                                float(weight), cn, min_priority, anonymous=anonymous,
                                via_trusted_header=via_header, cache_group=group,
                                sources=_sources(entry, where), max_adapters=_int(entry, "max_adapters", where),
                                adapter_pool_bytes=_int(entry, "adapter_pool_bytes", where)))
    if len(specs) > MAX_TENANTS:
        raise ValueError(f"tenants file: at most {MAX_TENANTS} tenants")
    return tuple(specs)


def read_tenants_file(path: str) -> tuple[TenantSpec, ...]:
    """JSON, or YAML (a superset) when PyYAML is there; `token_file` paths are relative to the file."""
    import os

    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        data = yaml.safe_load(text)
    return parse_tenants(data, os.path.dirname(os.path.abspath(path)))


class QuotaExceeded(ResourceExhaustedError):
    """A tenant over one of its quotas; `retry_after_s` is when a retry may pass."""

    def __init__(self, message: str, retry_after_s: float, reason: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


@dataclass
class _Usage:
    """One tenant's live counts (under Tenancy._lock)."""

    waiting: int = 0
    running: int = 0
    generated_tokens: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    bucket: float = 0.0
    bucket_at: float = 0.0


class Ticket:
    """One admitted request's hold on its tenant's quotas: `running()` at its first output, `release()`
    once at its end (later calls do nothing)."""

    def __init__(self, tenancy: Tenancy, tenant: Tenant, samples: int, prompt_tokens: int, reserved: int) -> None:
        self._tenancy, self.tenant, self.samples, self.reserved = tenancy, tenant, samples, reserved
        self.prompt_tokens = prompt_tokens
        self._running = False
        self._released = False

    def running(self) -> None:
        if not self._running and not self._released:
            self._running = True
            self._tenancy._move(self.tenant.name, self.samples)

    def release(self, used_tokens: int) -> None:
        if self._released:
            return
        self._released = True
        self._tenancy._release(self, used_tokens, self._running)


class Tenancy:
    """The front ends' shared tenant state: the directory, adapter bindings, quotas and metrics."""

    def __init__(self, specs: Iterable[TenantSpec] = (), admin_token: str | None = None,
                 trusted_header: str | None = None, metrics_top_k: int = 10,
                 clock: Callable[[], float] = time.monotonic, mtls: bool = False) -> None:
        self.specs = tuple(specs)
        # Any tenant configuration (a tenants file, a trusted header, an mTLS client CA): every request
        # needs a credential (or the declared anonymous tenant), and unknown bearer tokens are refused.
        self.enabled = bool(self.specs) or trusted_header is not None or mtls
        anonymous = next((s for s in self.specs if s.anonymous), None)
        # the tenant of requests without a credential; None: they are refused
        self.anonymous: Tenant | None = (
            Tenant(ANONYMOUS, spec=anonymous) if anonymous is not None or not self.enabled else None)
        self._by_digest = [(s.token_sha256, s) for s in self.specs if s.token_sha256 is not None]
        self._by_name = {s.name: s for s in self.specs}
        self._by_cn = {s.mtls_common_name: s for s in self.specs if s.mtls_common_name}
        self._admin = admin_token.encode() if admin_token else None
        self.trusted_header = trusted_header.lower() if trusted_header else None
        self.top_k = max(0, metrics_top_k)
        self._clock = clock
        self._lock = threading.Lock()
        self._usage: dict[str, _Usage] = {}
        self._folded = _Usage()  # counters of idle tenants no longer tracked one by one (_fold_idle)

    # ---- identity ----------------------------------------------------------------------------

    def resolve(self, metadata: Iterable[tuple[str, str | bytes]] | None, mtls_identity: str | None) -> Tenant:
        """The tenant of a request from its headers/metadata and its verified mTLS identity.
        A bearer token decides when there is one (the trusted header is then ignored); a repeated
        Authorization or trusted header is UNAUTHENTICATED, whichever value came first."""
        authorization: list[str | bytes] = []
        header: list[str | bytes] = []
        for key, value in metadata or ():
            k = key.lower()
            if k == "authorization":
                authorization.append(value)
            elif self.trusted_header is not None and k == self.trusted_header:
                header.append(value)
        checked = self.enabled or self._admin is not None
        if checked and len(authorization) > 1:
            raise UnauthenticatedError("the request has more than one authorization header")
        if len(header) > 1:
            raise UnauthenticatedError(f"the request has more than one {self.trusted_header} header")
        if authorization and checked:
            tenant = self._from_token(authorization[0])
            if tenant is not None:
                return tenant
        if header:
            raw = header[0]
            name = (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw).strip()
            spec = self._by_name.get(name)
            if spec is None or not spec.via_trusted_header:  # a header never names an admin either
                raise UnauthenticatedError(f"the {self.trusted_header} header names no tenant that accepts it")
            return Tenant(spec.name, spec=spec)
        if mtls_identity is not None:
            spec = self._by_cn.get(mtls_identity) or self._by_name.get(mtls_identity)
            name = spec.name if spec else mtls_identity
            if name in RESERVED_NAMES:
                raise UnauthenticatedError("the client certificate's subject is a reserved tenant name")
            return self._named(name)
        if self.anonymous is None:
            raise UnauthenticatedError("this server needs a credential (a bearer token) and declares no "
                                       "anonymous tenant")
        return self.anonymous

    def _named(self, name: str, admin_allowed: bool = True) -> Tenant:
        spec = self._by_name.get(name)
        return Tenant(name, admin=bool(admin_allowed and spec and spec.admin), spec=spec)

    def _from_token(self, value: str | bytes) -> Tenant | None:
        """The token's tenant; None: no tenants file and not the admin token (the old meaning: the
        admin routes judge it)."""
        raw = value.encode() if isinstance(value, str) else bytes(value)
        scheme, _, token = raw.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            if self.enabled:
                raise UnauthenticatedError("the authorization must be 'Bearer <token>'")
            return None
        if self._admin is not None and hmac.compare_digest(token, self._admin):
            return ADMIN_TENANT
        digest = hashlib.sha256(token).digest()
        found: TenantSpec | None = None
        for known, spec in self._by_digest:  # every entry compared: the time says nothing of which
            if hmac.compare_digest(digest, known):
                found = spec
        if found is not None:
            return Tenant(found.name, admin=found.admin, spec=found, from_token=True)
        if self.enabled:
            raise UnauthenticatedError("unknown bearer token")
        return None

    # ---- quotas ------------------------------------------------------------------------------

    @staticmethod
    def check_priority(tenant: Tenant, priority: int) -> None:
        """A request may ask for a priority at or above its tenant's min_priority (0 by default, so
        only tenants the operator allowed can jump ahead of the default); admins may ask for any."""
        floor = tenant.spec.min_priority if tenant.spec is not None else 0
        if not tenant.admin and priority < floor:
            raise InvalidArgumentError(f"priority {priority} is below {floor}, the lowest this tenant may ask for")

    def check_in_flight(self, tenant: Tenant) -> None:
        """The in-flight cap alone, before the request is even parsed: a tenant at its cap costs the
        front end no parsing or tokenizing (`admit` checks again, with the request's samples)."""
        spec = tenant.spec
        cap = spec.max_in_flight if spec is not None else None
        if cap is None:
            return
        if cap == 0:
            raise PermissionDeniedError("this tenant may run no requests (its max_running and max_queued are 0)")
        with self._lock:
            usage = self._usage.get(tenant.name)
            if usage is not None and usage.waiting + usage.running >= cap:
                self._refuse(usage, "requests")
                raise QuotaExceeded(f"tenant over its limit of {cap} requests running or queued", 1.0, "requests")

    def admit(self, tenant: Tenant, samples: int, prompt_tokens: int, max_new_tokens: int) -> Ticket:
        """The request's ticket (each of its n samples counts as one request in flight), or
        QuotaExceeded (nothing held; a retry may pass), or INVALID_ARGUMENT for a request that can
        never fit its tenant's caps (more samples than its in-flight cap, more tokens than its whole
        rate): a 429 there would have clients retry forever."""
        spec = tenant.spec
        reserved = samples * (prompt_tokens + max_new_tokens)
        cap = spec.max_in_flight if spec is not None else None
        rate = spec.tokens_per_minute if spec is not None else None
        if cap == 0:
            raise PermissionDeniedError("this tenant may run no requests (its max_running and max_queued are 0)")
        if cap is not None and samples > cap:
            raise InvalidArgumentError(
                f"n={samples} samples is more than its tenant's limit of {cap} requests running or queued")
        if rate is not None and reserved > rate:
            raise InvalidArgumentError(
                f"the request reserves {reserved} tokens (prompt + max_new_tokens per sample), more "
                f"than its tenant's tokens_per_minute of {rate}")
        with self._lock:
            usage = self._usage.get(tenant.name)
            if usage is None:
                if len(self._usage) >= MAX_TRACKED:
                    self._fold_idle()
                usage = self._usage[tenant.name] = _Usage()
            if cap is not None and usage.waiting + usage.running + samples > cap:
                self._refuse(usage, "requests")
                raise QuotaExceeded(f"tenant over its limit of {cap} requests running or queued", 1.0, "requests")
            if rate is not None:
                self._refill(usage, rate)
                if usage.bucket < reserved:
                    self._refuse(usage, "tokens")
                    wait = (reserved - usage.bucket) * 60.0 / rate
                    raise QuotaExceeded(f"tenant over its limit of {rate} tokens per minute", wait, "tokens")
                usage.bucket -= reserved
            usage.waiting += samples
        return Ticket(self, tenant, samples, prompt_tokens, reserved)

    def _refill(self, usage: _Usage, rate: int) -> None:
        now = self._clock()
        if usage.bucket_at == 0.0:
            usage.bucket, usage.bucket_at = float(rate), now
            return
        usage.bucket = min(float(rate), usage.bucket + (now - usage.bucket_at) * rate / 60.0)
        usage.bucket_at = now

    def _fold_idle(self) -> None:
        """Bounds the state that names from a trusted header or mTLS can create: idle tenants without a
        tenants-file entry (no token bucket to keep) are folded into the `other` counters."""
        for name in [n for n, u in self._usage.items()
                     if not u.waiting and not u.running and n not in self._by_name]:
            usage = self._usage.pop(name)
            self._folded.generated_tokens += usage.generated_tokens
            for reason, count in usage.refusals.items():
                self._folded.refusals[reason] = self._folded.refusals.get(reason, 0) + count

    @staticmethod
    def _refuse(usage: _Usage, reason: str) -> None:
        usage.refusals[reason] = usage.refusals.get(reason, 0) + 1

    def _move(self, name: str, samples: int) -> None:
        with self._lock:
            usage = self._usage[name]
            usage.waiting -= samples
            usage.running += samples

    def _release(self, ticket: Ticket, used_tokens: int, running: bool) -> None:
        spec = ticket.tenant.spec
        with self._lock:
            usage = self._usage[ticket.tenant.name]
            if running:
                usage.running -= ticket.samples
            else:
                usage.waiting -= ticket.samples
            usage.generated_tokens += max(0, used_tokens)
            if spec is not None and spec.tokens_per_minute is not None:
                self._refill(usage, spec.tokens_per_minute)
                # prompt tokens stay spent; what the samples did not generate comes back
                refund = max(0, ticket.reserved - used_tokens - ticket.prompt_tokens * ticket.samples)
                usage.bucket = min(float(spec.tokens_per_minute), usage.bucket + refund)

    def in_flight(self) -> dict[str, tuple[int, int]]:
        """(waiting, running) per tenant (tests, leak checks)."""
        with self._lock:
            return {name: (u.waiting, u.running) for name, u in self._usage.items()}

    # ---- metrics -----------------------------------------------------------------------------

    def collector(self) -> TenantCollector:
        return TenantCollector(self)

    def _labelled(self) -> list[tuple[str, _Usage]]:
        """The top-K tenants by generated tokens (then by name) under their own names, the rest
        summed as `other`."""
        with self._lock:
            items = [(n, _Usage(u.waiting, u.running, u.generated_tokens, dict(u.refusals)))
                     for n, u in self._usage.items()]
            folded = _Usage(0, 0, self._folded.generated_tokens, dict(self._folded.refusals))
        items.sort(key=lambda kv: (-kv[1].generated_tokens, kv[0]))
        top, rest = items[: self.top_k], items[self.top_k:]
        if folded.generated_tokens or folded.refusals:
            rest.append((OTHER, folded))
        if rest:
            other = _Usage()
            for _, u in rest:
                other.waiting += u.waiting
                other.running += u.running
                other.generated_tokens += u.generated_tokens
                for reason, count in u.refusals.items():
                    other.refusals[reason] = other.refusals.get(reason, 0) + count
            top.append((OTHER, other))
        return top


class TenantCollector:
    """Per-tenant series with bounded cardinality: at most top-K tenant labels plus `other`.
    Membership is recomputed at each scrape (as AdapterTraffic's)."""

    def __init__(self, tenancy: Tenancy) -> None:
        self.tenancy = tenancy

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rows = self.tenancy._labelled()
        running = GaugeMetricFamily("loraplex_tenant_requests_running",
                                    "Requests of a tenant streaming (their first output sent)", labels=["tenant"])
        waiting = GaugeMetricFamily("loraplex_tenant_requests_waiting",
                                    "Requests of a tenant admitted, no output yet", labels=["tenant"])
        tokens = CounterMetricFamily("loraplex_tenant_generated_tokens",
                                     "Tokens generated for a tenant", labels=["tenant"])
        refusals = CounterMetricFamily("loraplex_tenant_quota_refusals",
                                       "Requests refused by a tenant quota (RESOURCE_EXHAUSTED / HTTP 429)",
                                       labels=["tenant", "quota"])
        for name, usage in rows:
            running.add_metric([name], usage.running)
            waiting.add_metric([name], usage.waiting)
            tokens.add_metric([name], usage.generated_tokens)
            for quota in ("requests", "tokens"):
                refusals.add_metric([name, quota], usage.refusals.get(quota, 0))
        yield from (running, waiting, tokens, refusals)
