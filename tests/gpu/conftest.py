"""Reference outputs shared by the runner tests, computed once per session."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gpu.reference import GreedyCase, greedy_cases


@pytest.fixture(scope="session")
def tiny_greedy_cases(tiny_reference: Any) -> list[GreedyCase]:
    return greedy_cases(tiny_reference)
