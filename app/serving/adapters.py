"""The LoRA adapters the server serves, by name, and which tenants may use each.

A request names its adapter as `model`. An adapter a tenant may not use is, to that tenant, a model
that does not exist: the same 404, so a tenant cannot learn another's adapter names. Folders are read
and checked by the runner (`AdapterReader`), off the event loop; a bad folder is an error naming its
file and leaves what is served unchanged. Unloading takes the name away at once (new requests get 404)
while the requests already running on it finish: they hold its `LoraRef`, not its name.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from app.plumbing.errors import APIError
from config.settings import AdapterEntry, SettingsError
from contract.plan import LoraRef
from gpu.lora import AdapterError
from tenancy.tenants import Tenant


@runtime_checkable
class AdapterReader(Protocol):
    """The runner's side: read an adapter's folder (AdapterError naming the file), and forget one."""

    def check_adapter(self, adapter: LoraRef) -> None: ...

    def forget_adapter(self, name: str) -> None: ...


@dataclass(slots=True, frozen=True)
class ServedAdapter:
    ref: LoraRef
    tenants: frozenset[str] | None  # who may use it; None: every tenant


class AdapterRegistry:
    def __init__(self, reader: AdapterReader, *, requires_auth: bool) -> None:
        self._reader = reader
        self._requires_auth = requires_auth  # without a tenants file every caller may use every adapter
        self._served: dict[str, ServedAdapter] = {}
        self._versions = itertools.count(1)
        self._lock = threading.Lock()  # loads run in worker threads

    @classmethod
    def at_start(cls, reader: AdapterReader, entries: Iterable[AdapterEntry], *, requires_auth: bool
                 ) -> AdapterRegistry:
        """The registry of the adapters served from start-up; a bad folder stops the start (SettingsError)."""
        registry = cls(reader, requires_auth=requires_auth)
        for entry in entries:
            if registry.is_served(entry.name):
                raise SettingsError(f"adapter '{entry.name}' is named twice (--lora-modules and [[adapters]])")
            try:
                registry.load(entry.name, entry.path, entry.tenants)
            except (AdapterError, ValueError) as exc:
                raise SettingsError(str(exc)) from None
        return registry

    def is_served(self, name: str) -> bool:
        return name in self._served

    def usable_by(self, tenant: Tenant, name: str) -> LoraRef | None:
        """The adapter of that name if this tenant may use it, else None."""
        served = self._served.get(name)
        return served.ref if served is not None and self._may_use(tenant, served) else None

    def visible_to(self, tenant: Tenant) -> list[LoraRef]:
        return [s.ref for s in self._served.values() if self._may_use(tenant, s)]

    def _may_use(self, tenant: Tenant, served: ServedAdapter) -> bool:
        return not self._requires_auth or served.tenants is None or tenant.tenant_id in served.tenants

    def load(self, name: str, path: str, tenants: Iterable[str] | None = None) -> LoraRef:
        """Read and check the folder, then serve it under the name (a new version if the name was served).
        Blocking: call it off the event loop. AdapterError (naming the file) or ValueError when it cannot be."""
        if not name or name != name.strip():
            raise ValueError(f"adapter name {name!r} must be non-empty, without surrounding spaces")
        ref = LoraRef(name, path, next(self._versions))
        self._reader.check_adapter(ref)
        with self._lock:
            self._served[name] = ServedAdapter(ref, None if tenants is None else frozenset(tenants))
        return ref

    def reload(self, name: str, path: str) -> LoraRef:
        """`load` for the operator's endpoint: a name already served keeps the tenants it had (a reload of a
        tenant's private adapter must not make it everyone's); a new name is every tenant's."""
        served = self._served.get(name)
        return self.load(name, path, None if served is None else served.tenants)

    def unload(self, name: str) -> bool:
        """Stop serving the name; False if it was not served. Running requests on it finish."""
        with self._lock:
            served = self._served.pop(name, None)
        if served is not None:
            self._reader.forget_adapter(name)
        return served is not None


def unknown_model(model: str, served_model: str) -> APIError:
    """The 404 of a model this server does not serve, or of an adapter the tenant may not use: one answer."""
    return APIError(404, f"The model '{model}' does not exist; this server serves '{served_model}'.",
                    param="model", code="model_not_found")


def adapter_of(registry: AdapterRegistry | None, model: str, base_model: str, tenant: Tenant) -> LoraRef | None:
    """The LoRA adapter a request of this tenant names as its model; None for the base model; else the 404."""
    if model == base_model:
        return None
    adapter = registry.usable_by(tenant, model) if registry is not None else None
    if adapter is None:
        raise unknown_model(model, base_model)
    return adapter
