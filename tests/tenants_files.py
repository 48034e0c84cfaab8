"""Tenants files for the tests that start a server: the TOML `tenancy/tenants.py` reads, written from
each tenant's API key and settings, so a test states only what differs between its tenants."""

from __future__ import annotations

import json
from collections.abc import Mapping

from tenancy.tenants import hash_api_key

TomlValue = str | int | float | list[str]


def tenants_toml(keys: Mapping[str, str], *, admin_key: str | None = None,
                 settings: Mapping[str, Mapping[str, TomlValue]] | None = None) -> str:
    """A `[[tenants]]` table per tenant id of `keys`, with the hash of its key and its `settings`
    (weight, limits, classes, cache_group...), and an `[admin]` table when admin_key is given."""
    tables = [f'[admin]\napi_key_hashes = ["{hash_api_key(admin_key)}"]\n'] if admin_key is not None else []
    for tenant_id, key in keys.items():
        lines = [f"id = {json.dumps(tenant_id)}", f'api_key_hashes = ["{hash_api_key(key)}"]']
        lines += [f"{name} = {_toml_value(value)}" for name, value in (settings or {}).get(tenant_id, {}).items()]
        tables.append("[[tenants]]\n" + "\n".join(lines) + "\n")
    return "\n".join(tables)


def _toml_value(value: TomlValue) -> str:
    # TOML's basic strings and arrays of them are written as JSON writes them (ASCII here); numbers as Python does.
    return json.dumps(value) if isinstance(value, str | list) else repr(value)
