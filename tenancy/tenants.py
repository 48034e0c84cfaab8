"""Tenants: who they are, their weight, their keys (hashes only), their classes and limits.

Tenants come from a TOML file of `[[tenants]]` entries, and an optional `[admin]` table whose
`api_key_hashes` open the operator endpoints (/stats, /metrics, /dashboard). Without a file there is
a single tenant, `default`, and no authentication anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NewType

from pydantic import ValidationError

from config.settings import AdapterEntry

TenantId = NewType("TenantId", str)
DEFAULT_TENANT = TenantId("default")
PRIORITY_CLASSES = ("interactive", "batch")
KEY_HASH_PREFIX = "sha256:"


class TenantsFileError(ValueError):
    """The tenants file is malformed; the message names the entry and the field."""


@dataclass(slots=True, frozen=True)
class TenantLimits:
    """Admission limits; None means no limit."""

    max_concurrent: int | None = None  # requests being served at once
    max_queued: int | None = None  # requests waiting beyond max_concurrent
    tokens_per_minute: int | None = None  # token bucket: prompt + max_tokens charged at admission
    max_prompt_tokens: int | None = None
    # Files kept for the Files and Batch APIs: how many, and their bytes together (None: the server's default)
    max_files: int | None = None
    max_file_bytes: int | None = None
    # Stored Responses API responses: how many and their bytes together (past either, the oldest finished
    # ones go), and background responses queued or running at once (None: the server's defaults)
    max_stored_responses: int | None = None
    max_stored_response_bytes: int | None = None
    max_background_responses: int | None = None
    # Each interactive request's first token is due this many ms after it arrives (unless the request sets
    # its own TTFT deadline): its line orders it by slack (scheduling/queue_order.py)
    ttft_target_ms: int | None = None
    # Steps that run one of its interactive requests hold batch work to this many ms (at most: the server's
    # derived target still holds when it is tighter)
    itl_target_ms: int | None = None


@dataclass(slots=True, frozen=True)
class Tenant:
    tenant_id: TenantId
    weight: float = 1.0
    api_key_hashes: tuple[str, ...] = ()
    classes: frozenset[str] = frozenset(PRIORITY_CLASSES)
    limits: TenantLimits = field(default_factory=TenantLimits)
    cache_group: str | None = None  # tenants naming the same group share prefix-cache entries

    def cache_salt_for(self, request_salt: str | None = None, adapter: str | None = None) -> str:
        """The prefix-cache salt of this tenant's request: its cache group or itself, the request's
        own salt, and its LoRA adapter when it has one (two adapters never share KV), JSON-encoded so
        that no tenant id or salt can be made to read as another's (a `|`-joined string let the tenant
        'a|request:b' share the salted prefix of tenant 'a' with salt 'b')."""
        owner = ["group", self.cache_group] if self.cache_group else ["tenant", self.tenant_id]
        parts = [*owner, request_salt] if adapter is None else [*owner, request_salt, "adapter", adapter]
        return json.dumps(parts, ensure_ascii=False, separators=(",", ":"))


def hash_api_key(key: str) -> str:
    return KEY_HASH_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_api_key() -> str:
    return "fl-" + secrets.token_urlsafe(32)


class TenantRegistry:
    """Looks tenants up by id and by API key. Keys are compared in constant time."""

    def __init__(self, tenants: Iterable[Tenant], *, requires_auth: bool, admin_key_hashes: Iterable[str] = (),
                 adapters: Iterable[AdapterEntry] = ()) -> None:
        self._tenants = {t.tenant_id: t for t in tenants}
        self.adapters = tuple(adapters)  # the file's [[adapters]]: LoRA adapters and the tenants that may use them
        self._weights: dict[str, float] = {t.tenant_id: t.weight for t in self._tenants.values()}  # per tenant per step
        self.requires_auth = requires_auth
        self._key_hashes = [(h.encode(), t) for t in self._tenants.values() for h in t.api_key_hashes]
        self._admin_key_hashes = [h.encode() for h in admin_key_hashes]
        self._stand_ins: dict[str, Tenant] = {}

    @classmethod
    def single_default(cls) -> TenantRegistry:
        return cls([Tenant(DEFAULT_TENANT)], requires_auth=False)

    def __iter__(self) -> Any:
        return iter(self._tenants.values())

    def is_listed(self, tenant_id: str) -> bool:
        """Whether the id is a tenant of the file (every id is, without a file): work stored for an id the
        file no longer lists must end, not run under an unlimited stand-in."""
        return not self.requires_auth or tenant_id in self._tenants

    def get(self, tenant_id: str) -> Tenant:
        """The tenant, or an unlimited weight-1 stand-in for ids not in the file (tests, tools). The
        scheduler asks for every sequence of every step, so stand-ins are made once."""
        found = self._tenants.get(TenantId(tenant_id))
        if found is None:
            found = self._stand_ins.get(tenant_id)
            if found is None:
                found = self._stand_ins[tenant_id] = Tenant(TenantId(tenant_id))
        return found

    def weight(self, tenant_id: str) -> float:
        weight = self._weights.get(tenant_id)
        return weight if weight is not None else self.get(tenant_id).weight

    def max_concurrent_limits(self) -> dict[str, int]:
        """The tenants with a max_concurrent limit, and that limit (stand-ins have none)."""
        return {t.tenant_id: t.limits.max_concurrent for t in self._tenants.values()
                if t.limits.max_concurrent is not None}

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The tenant owning this key; None for a missing or unknown key. Every hash is compared,
        so timing tells nothing about which one matched or how much of it."""
        if not self.requires_auth:
            return self._tenants.get(DEFAULT_TENANT)
        if not api_key:
            return None
        presented = hash_api_key(api_key).encode()
        found: Tenant | None = None
        for known, tenant in self._key_hashes:
            if hmac.compare_digest(presented, known):
                found = tenant
        return found

    def is_admin(self, api_key: str | None) -> bool:
        """Whether the key opens the operator endpoints: any key without a tenants file, else one of
        the `[admin]` hashes (compared in constant time, like tenant keys)."""
        if not self.requires_auth:
            return True
        if not api_key:
            return False
        presented = hash_api_key(api_key).encode()
        return any([hmac.compare_digest(presented, known) for known in self._admin_key_hashes])


def _positive_int(entry: str, data: Mapping[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TenantsFileError(f"{entry}: '{key}' must be a positive integer, got {value!r}")
    return value


def _parse_classes(entry: str, raw: Any) -> frozenset[str]:
    if raw is None:
        return frozenset(PRIORITY_CLASSES)
    if not isinstance(raw, list) or not raw or any(c not in PRIORITY_CLASSES for c in raw):
        raise TenantsFileError(f"{entry}: 'classes' must be a non-empty list of {list(PRIORITY_CLASSES)}")
    return frozenset(raw)


def _parse_key_hashes(entry: str, raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list) or any(not isinstance(h, str) for h in raw):
        raise TenantsFileError(f"{entry}: 'api_key_hashes' must be a list of \"sha256:<hex>\" strings")
    for h in raw:
        digest = h.removeprefix(KEY_HASH_PREFIX)
        if not h.startswith(KEY_HASH_PREFIX) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise TenantsFileError(f"{entry}: 'api_key_hashes' entry {h!r} is not \"sha256:<64 hex digits>\"")
    return tuple(raw)


LIMIT_FIELDS = ("max_concurrent", "max_queued", "tokens_per_minute", "max_prompt_tokens", "max_files",
                "max_file_bytes", "max_stored_responses", "max_stored_response_bytes", "max_background_responses",
                "ttft_target_ms", "itl_target_ms")
KNOWN_FIELDS = {"id", "weight", "api_key_hashes", "classes", "cache_group", *LIMIT_FIELDS}


def parse_tenant(index: int, data: Any) -> Tenant:
    entry = f"tenants[{index}]"
    if not isinstance(data, dict):
        raise TenantsFileError(f"{entry}: must be a table")
    unknown = sorted(set(data) - KNOWN_FIELDS)
    if unknown:
        raise TenantsFileError(f"{entry}: unknown field '{unknown[0]}'")
    tenant_id = data.get("id")
    if not isinstance(tenant_id, str) or not tenant_id:
        raise TenantsFileError(f"{entry}: 'id' must be a non-empty string")
    entry = f"tenants[{index}] (id '{tenant_id}')"
    weight = data.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise TenantsFileError(f"{entry}: 'weight' must be a finite number > 0, got {weight!r}")
    cache_group = data.get("cache_group")
    if cache_group is not None and (not isinstance(cache_group, str) or not cache_group):
        raise TenantsFileError(f"{entry}: 'cache_group' must be a non-empty string")
    limits = TenantLimits(*(_positive_int(entry, data, k) for k in LIMIT_FIELDS))
    return Tenant(TenantId(tenant_id), float(weight), _parse_key_hashes(entry, data.get("api_key_hashes", [])),
                  _parse_classes(entry, data.get("classes")), limits, cache_group)


def load_tenants(path: str | Path) -> TenantRegistry:
    """Read and validate a tenants file; any problem raises TenantsFileError naming entry and field."""
    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except FileNotFoundError as exc:
        raise TenantsFileError(f"tenants file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"tenants file {path} is not valid TOML: {exc}") from exc
    entries = document.get("tenants")
    if not isinstance(entries, list) or not entries:
        raise TenantsFileError(f"tenants file {path}: expected one or more [[tenants]] entries")
    tenants = [parse_tenant(i, data) for i, data in enumerate(entries)]
    check_unique_ids(tenants)
    admin_key_hashes = _parse_admin(document.get("admin"))
    check_unique_keys(tenants, admin_key_hashes)
    return TenantRegistry(tenants, requires_auth=True, admin_key_hashes=admin_key_hashes,
                          adapters=_parse_adapters(document.get("adapters", [])))


def check_unique_ids(tenants: Iterable[Tenant]) -> None:
    seen: set[str] = set()
    for i, tenant in enumerate(tenants):
        if tenant.tenant_id in seen:
            raise TenantsFileError(f"tenants[{i}]: 'id' '{tenant.tenant_id}' appears twice")
        seen.add(tenant.tenant_id)


def check_unique_keys(tenants: Iterable[Tenant], admin_key_hashes: Iterable[str]) -> None:
    """One key opens one door: a hash listed twice would let the last tenant with it win, silently."""
    owner: dict[str, str] = {key_hash: "admin" for key_hash in admin_key_hashes}
    for i, tenant in enumerate(tenants):
        for key_hash in tenant.api_key_hashes:
            if key_hash in owner:
                holder = "the admin" if owner[key_hash] == "admin" else f"tenant '{owner[key_hash]}'"
                raise TenantsFileError(f"tenants[{i}] ('{tenant.tenant_id}'): a key hash it lists is also "
                                       f"{holder}'s; each key must open one door")
            owner[key_hash] = tenant.tenant_id


def _parse_adapters(raw: Any) -> tuple[AdapterEntry, ...]:
    """[[adapters]] entries: name, path, and the ids of the tenants that may use the adapter (all when absent)."""
    if not isinstance(raw, list):
        raise TenantsFileError("adapters: must be [[adapters]] tables")
    entries = []
    for index, data in enumerate(raw):
        try:
            entries.append(AdapterEntry.model_validate(data))
        except ValidationError as exc:
            problem = "; ".join(f"'{'.'.join(map(str, e['loc']))}': {e['msg']}" for e in exc.errors())
            raise TenantsFileError(f"adapters[{index}]: {problem}") from None
    return tuple(entries)


def _parse_admin(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict) or set(raw) - {"api_key_hashes"}:
        raise TenantsFileError("admin: must be a table with only 'api_key_hashes'")
    return _parse_key_hashes("admin", raw.get("api_key_hashes", []))


NEW_TENANT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # written into TOML unescaped, so kept plain


def append_tenant(path: str | Path, tenant_id: str, weight: float) -> str:
    """Add a tenant with a fresh key to the file (created if missing); returns the key, stored only hashed."""
    if not NEW_TENANT_ID.fullmatch(tenant_id):
        raise TenantsFileError(f"tenant id {tenant_id!r} must be 1-64 letters, digits, '.', '_' or '-'")
    if not math.isfinite(weight) or weight <= 0:
        raise TenantsFileError("weight must be a finite number > 0")
    key = new_api_key()
    file = Path(path)
    if file.exists():
        existing = load_tenants(file)
        if any(t.tenant_id == tenant_id for t in existing):
            raise TenantsFileError(f"tenant '{tenant_id}' already exists in {path}")
    block = (f'\n[[tenants]]\nid = "{tenant_id}"\nweight = {float(weight)}\n'
             f'api_key_hashes = ["{hash_api_key(key)}"]\n')
    with open(file, "a", encoding="utf-8") as handle:
        handle.write(block)
    load_tenants(file)  # the file must still parse
    return key


def append_admin_key(path: str | Path) -> str:
    """Add an `[admin]` table with a fresh operator key to an existing tenants file; returns the key."""
    file = Path(path)
    document = tomllib.loads(file.read_text(encoding="utf-8")) if file.exists() else {}
    if "admin" in document:
        raise TenantsFileError(f"{path} already has an [admin] table: add the hash of a new key to it by hand")
    key = new_api_key()
    with open(file, "a", encoding="utf-8") as handle:
        handle.write(f'\n[admin]\napi_key_hashes = ["{hash_api_key(key)}"]\n')
    return key
