"""The executor protocol the scheduler's engine drives; the model runner satisfies it structurally."""

from __future__ import annotations

from typing import Protocol

from gpu.plan import CacheGeometry, StepPlan, StepResult


class Executor(Protocol):
    """Runs step plans. The model runner is one; tests use a fake that costs a known time."""

    @property
    def geometry(self) -> CacheGeometry: ...

    def execute(self, plan: StepPlan) -> StepResult: ...
