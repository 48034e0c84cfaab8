"""What the HTTP handlers share: the settings, the engine, the tokenizer, and whether we are stopping."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.observability.metrics import ReplicaSnapshots
from app.serving.adapters import AdapterReader, AdapterRegistry, adapter_of
from app.serving.admission import AdmissionGate
from app.serving.off_loop import OffLoop
from config.settings import Settings, SettingsError
from contract.plan import CacheGeometry
from gpu.runner import ModelRunner
from gpu.tokenizer import Tokenizer
from scheduling.engine import EngineFront
from tenancy.tenants import Tenant


@dataclass(slots=True)
class ServingContext:
    settings: Settings
    engine: EngineFront  # built, not yet started: the app's lifespan starts and stops it
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))  # reported as the model's creation time
    is_draining: bool = False  # set once on shutdown: new generations get 503, /health says not ready
    # On a cluster's ingress: each replica's latest snapshot, for /metrics (this engine never steps).
    replica_snapshots: ReplicaSnapshots | None = None
    gate: AdmissionGate = field(init=False)  # authentication, class rights and quotas, per the engine's tenants
    adapters: AdapterRegistry | None = field(init=False)  # the LoRA adapters served; None without enable_lora
    off_loop: OffLoop = field(init=False)  # each tenant's heavy parsing and rendering

    def __post_init__(self) -> None:
        self.gate = AdmissionGate(self.engine.tenants, self.engine)
        self.off_loop = OffLoop(cpu_share=self.settings.tenant_prepare_cpu_share)
        self.adapters = self._adapter_registry()

    def _adapter_registry(self) -> AdapterRegistry | None:
        """With enable_lora, the adapters of the settings (--lora-modules, [[adapters]]) and of the tenants
        file, each folder read and checked now: a bad one stops the start with an error naming its file."""
        if not self.settings.enable_lora:
            return None
        reader = self.engine.executor
        if not isinstance(reader, AdapterReader):
            raise SettingsError("enable_lora needs the in-process model runner")
        tenants = self.engine.tenants
        return AdapterRegistry.at_start(reader, (*self.settings.start_adapters(), *tenants.adapters),
                                        requires_auth=tenants.requires_auth)

    def check_model(self, model: str, tenant: Tenant) -> None:
        """The 404 of a model this tenant cannot use: neither the base model nor an adapter it has the
        right to. Rights and existence are one question (`adapter_of`), asked before anything else of the
        body is: an adapter of another tenant's answers as a missing model does, on every path."""
        adapter_of(self.adapters, model, self.model_name, tenant)

    def start_compiling(self) -> None:
        """The runner's background compilation starts once the server is up (app lifespan)."""
        executor = self.engine.executor
        if isinstance(executor, ModelRunner):
            executor.start_compiling()

    def compile_status(self) -> dict[str, Any] | None:
        """How far the forward's background compilation has come (`fairlane serve` answers eagerly until
        it is done); None when the forward was ready at start-up, or no runner of this process steps."""
        executor = self.engine.executor
        status = executor.compile_status if isinstance(executor, ModelRunner) else None
        return None if status is None else status.as_json()

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self.settings.model

    @property
    def geometry(self) -> CacheGeometry:
        return self.engine.executor.geometry
