"""What the load tool sends: its tenants, seeded prompt and output lengths, and the request bodies.

The load tool's tenants file holds plain API keys (the client side needs them); the server's file
holds only their hashes. `python -m loadtest.tenants` writes the second from the first.

```toml
[[tenants]]
id = "alice"          # must match the server's tenant id (reports are keyed by it)
api_key = "fl-..."    # sent as "Authorization: Bearer fl-..."
weight = 2            # optional, default 1: must match the server's weight for Jain's index to mean anything
```
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tenancy.tenants import Tenant, TenantsFileError, check_unique_ids, hash_api_key, parse_tenant

INTERACTIVE = "interactive"
BATCH = "batch"  # a chat request sent with service_tier "flex"
BATCH_API = "batch-api"  # an item of a Batch API job


class LoadTenantsError(ValueError):
    """The load tool's tenants file is malformed; the message names the entry and field."""


@dataclass(slots=True, frozen=True)
class LoadTenant:
    tenant_id: str
    api_key: str | None  # None: no Authorization header (a server without a tenants file)
    weight: float = 1.0

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# What a server without a tenants file calls its single tenant.
ANONYMOUS = LoadTenant("default", None)


def load_tenants(path: str | Path) -> tuple[LoadTenant, ...]:
    """Read the load tool's tenants file; any problem raises LoadTenantsError naming the entry. It is the
    server's format with each key in the clear (`api_key`, which the client sends) where the server's
    holds its hash: every other field is read by the server's own parser, so both accept the same."""
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LoadTenantsError(f"cannot read tenants file {path}: {exc}") from exc
    entries = document.get("tenants")
    if not isinstance(entries, list) or not entries:
        raise LoadTenantsError(f"{path}: expected one or more [[tenants]] entries")
    try:
        tenants = [_parse_tenant(i, entry) for i, entry in enumerate(entries)]
        check_unique_ids(tenant for tenant, _ in tenants)
    except TenantsFileError as exc:
        raise LoadTenantsError(f"{path}: {exc}") from None
    return tuple(LoadTenant(tenant.tenant_id, api_key, tenant.weight) for tenant, api_key in tenants)


def load_admin_key(path: str | Path) -> str | None:
    """The operator key of the tenants file's `[admin] api_key`, used to read the server's /stats."""
    try:
        admin = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("admin")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LoadTenantsError(f"cannot read tenants file {path}: {exc}") from exc
    if admin is None:
        return None
    if not isinstance(admin, dict) or set(admin) != {"api_key"} or not isinstance(admin["api_key"], str):
        raise LoadTenantsError(f"{path}: [admin] must hold only 'api_key', a string")
    key: str = admin["api_key"]
    return key


def _parse_tenant(index: int, entry: Any) -> tuple[Tenant, str]:
    """The entry as the server reads it (its key hashed), and its key."""
    where = f"tenants[{index}]"
    if not isinstance(entry, dict):
        raise LoadTenantsError(f"{where}: must be a table")
    if "api_key_hashes" in entry:
        raise LoadTenantsError(f"{where}: the load tool needs each key in the clear: 'api_key', not 'api_key_hashes'")
    api_key = entry.get("api_key")
    if not isinstance(api_key, str) or not api_key:
        raise LoadTenantsError(f"{where}: 'api_key' must be a non-empty string")
    fields = {name: value for name, value in entry.items() if name != "api_key"}
    return parse_tenant(index, {**fields, "api_key_hashes": [hash_api_key(api_key)]}), api_key


@dataclass(slots=True, frozen=True)
class LengthDist:
    """A log-normal length, rounded and clipped: most requests short, a long tail, like real chat."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.high, max(self.low, value))


CHAT_PROMPT_WORDS = LengthDist(median=40, sigma=0.8, low=4, high=400)
CHAT_OUTPUT_TOKENS = LengthDist(median=48, sigma=0.6, low=8, high=256)
BATCH_PROMPT_WORDS = LengthDist(median=80, sigma=0.6, low=16, high=400)
BATCH_OUTPUT_TOKENS = LengthDist(median=96, sigma=0.4, low=32, high=256)
QUESTION_WORDS = LengthDist(median=12, sigma=0.5, low=4, high=40)
SYSTEM_PROMPT_WORDS = 300

WORD_TEXT = (
    "the of and to in is that it for on with as was be by this are from at or an have not which but "
    "they you we all can more one has their will there about what when so would if out up some time "
    "people into other than its only also new could how most after first two work like year use may "
    "such these over where many well should because each those through very same before state world "
    "between under while system model server request token memory cache latency tenant queue batch "
    "stream answer question explain describe summarize compare write short simple list reason why "
    "history science music river mountain city language garden kitchen travel market energy health"
)
WORDS = tuple(WORD_TEXT.split())


def prompt_text(rng: random.Random, num_words: int) -> str:
    """Seeded filler text of num_words words, in sentences of 6-14 words."""
    words: list[str] = []
    while len(words) < num_words:
        sentence = [rng.choice(WORDS) for _ in range(min(rng.randint(6, 14), num_words - len(words)))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        words.extend(sentence)
    return " ".join(words)


def shared_system_prompt(seed: int) -> str:
    """The system prompt every request of the shared-prefix scenario starts with."""
    return "You are a careful assistant. " + prompt_text(random.Random(f"system/{seed}"), SYSTEM_PROMPT_WORDS)


@dataclass(slots=True, frozen=True)
class ChatRequest:
    """One chat completion the load tool will send."""

    tenant: LoadTenant
    klass: str  # INTERACTIVE, BATCH or BATCH_API
    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int  # generated exactly: ignore_eos is set, so the drawn length is the output length
    drop_after_chunks: int | None = None  # the client disconnects after this many content chunks
    extra_fields: str = ""  # JSON object text of more body fields (logprobs, response_format...), merged last

    def body(self, model: str, *, stream: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": role, "content": content} for role, content in self.messages],
        }
        if self.extra_fields:
            body |= json.loads(self.extra_fields)
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        if self.klass != INTERACTIVE:
            body["service_tier"] = "flex"
        return body


def chat_request(tenant: LoadTenant, rng: random.Random) -> ChatRequest:
    text = prompt_text(rng, CHAT_PROMPT_WORDS.draw(rng))
    return ChatRequest(tenant, INTERACTIVE, (("user", text),), CHAT_OUTPUT_TOKENS.draw(rng))


def batch_request(tenant: LoadTenant, rng: random.Random, klass: str = BATCH) -> ChatRequest:
    text = "Summarize this: " + prompt_text(rng, BATCH_PROMPT_WORDS.draw(rng))
    return ChatRequest(tenant, klass, (("user", text),), BATCH_OUTPUT_TOKENS.draw(rng))


def shared_prefix_request(tenant: LoadTenant, rng: random.Random, system_prompt: str) -> ChatRequest:
    question = prompt_text(rng, QUESTION_WORDS.draw(rng))
    return ChatRequest(tenant, INTERACTIVE, (("system", system_prompt), ("user", question)),
                       CHAT_OUTPUT_TOKENS.draw(rng))


def disconnect_request(tenant: LoadTenant, rng: random.Random, drop_share: float = 0.5) -> ChatRequest:
    """A chat request; drop_share of them leave after 1-5 chunks of an output long enough to still be
    running then."""
    request = chat_request(tenant, rng)
    drop_after = rng.randint(1, 5) if rng.random() < drop_share else None
    return ChatRequest(tenant, INTERACTIVE, request.messages, max(request.max_tokens, 64), drop_after)


def server_tenants_toml(tenants: tuple[LoadTenant, ...], admin_key: str | None = None) -> str:
    """The server's tenants file for these tenants: same ids and weights, keys only as hashes."""
    # json.dumps writes a string TOML reads back unchanged (basic strings share JSON's escapes).
    blocks = [f'[[tenants]]\nid = {json.dumps(t.tenant_id)}\nweight = {t.weight}\n'
              f'api_key_hashes = ["{hash_api_key(t.api_key or "")}"]\n' for t in tenants]
    if admin_key is not None:
        blocks.insert(0, f'[admin]\napi_key_hashes = ["{hash_api_key(admin_key)}"]\n')
    return "\n".join(blocks)
