"""What the HTTP handlers share: the settings, the engine, the tokenizer, and whether we are stopping."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from app.serving.admission import AdmissionGate
from config.settings import Settings
from contract.plan import CacheGeometry
from gpu.tokenizer import Tokenizer
from scheduling.engine import EngineFront
from scheduling.snapshot import SchedulerSnapshot


@dataclass(slots=True)
class ServingContext:
    settings: Settings
    engine: EngineFront  # built, not yet started: the app's lifespan starts and stops it
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))  # reported as the model's creation time
    is_draining: bool = False  # set once on shutdown: new generations get 503, /health says not ready
    # On a cluster's ingress: each replica's latest snapshot, for /metrics (this engine never steps).
    replica_snapshots: Callable[[], Mapping[str, SchedulerSnapshot]] | None = None
    gate: AdmissionGate = field(init=False)  # authentication, class rights and quotas, per the engine's tenants

    def __post_init__(self) -> None:
        self.gate = AdmissionGate(self.engine.tenants, self.engine)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self.settings.model

    @property
    def geometry(self) -> CacheGeometry:
        return self.engine.executor.geometry
