"""The executor protocol the scheduler's engine drives; the model runner satisfies it structurally."""

from __future__ import annotations

from typing import Protocol

from contract.plan import CacheGeometry, StepPlan, StepResult, StructuredOutput


class Executor(Protocol):
    """Runs step plans. The model runner is one; tests use a fake that costs a known time."""

    @property
    def geometry(self) -> CacheGeometry: ...

    def execute(self, plan: StepPlan) -> StepResult: ...

    def check_structured(self, structured: StructuredOutput) -> None:
        """Raise ValueError when the grammar cannot constrain this model's output (the API answers 400
        before submitting). May block: callers run it off the event loop."""
        ...
