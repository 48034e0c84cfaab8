"""tests/isolation.py: a test body runs in another process, gets its arguments there, and fails here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.isolation import call_in_fresh_process, in_fresh_process


@in_fresh_process
def note_pid_then_fail(folder: Path, name: str) -> None:
    (folder / name).write_text(str(os.getpid()))
    raise AssertionError(f"{name} failed")


def test_a_decorated_body_runs_in_another_process_and_its_failure_comes_back(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="the child failed"):
        note_pid_then_fail(tmp_path, name="the child")
    assert int((tmp_path / "the child").read_text()) != os.getpid()


def test_a_function_returns_its_result_from_another_process() -> None:
    assert call_in_fresh_process(os.getpid) != os.getpid()
