"""An engine whose step can run nothing waits for a command instead of spinning on empty steps."""

from __future__ import annotations

import asyncio
import time

import pytest

from contract.plan import StepPlan
from scheduling import engine as engine_module
from tests.factories import make_fake_engine, make_request, plans_of, running, wait_until


def nothing_can_run(engine: engine_module.Engine) -> None:
    """Work waits, but every step plans nothing (as for a request waiting on something no step gives)."""
    engine.scheduler.schedule = StepPlan  # type: ignore[method-assign]


async def test_empty_steps_come_at_the_backoff_pace_not_in_a_spin() -> None:
    engine = make_fake_engine()
    nothing_can_run(engine)
    async with running(engine):
        engine.submit(make_request(8, 4))
        await wait_until(lambda: len(plans_of(engine)) >= 1, what="a first empty step")
        first, started = len(plans_of(engine)), time.monotonic()
        await asyncio.sleep(0.5)  # a window to count steps in, not a wait for a condition
        steps, seconds = len(plans_of(engine)) - first, time.monotonic() - started
    assert all(plan.is_empty for plan in plans_of(engine))
    # Without the backoff a fake step takes microseconds: thousands of empty steps in this window.
    assert steps <= seconds / engine_module.EMPTY_STEP_BACKOFF_S + 10


async def test_a_command_ends_the_wait_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "EMPTY_STEP_BACKOFF_S", 600.0)
    engine = make_fake_engine()
    nothing_can_run(engine)
    async with running(engine):
        engine.submit(make_request(8, 4))
        await wait_until(lambda: len(plans_of(engine)) >= 1, what="a first empty step")
        engine.submit(make_request(8, 4))  # a command: the loop plans again now, not in 600 s
        await wait_until(lambda: len(plans_of(engine)) >= 2, timeout=5, what="a step after the command")
