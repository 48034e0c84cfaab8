"""`fairlane serve` with a compiled mode answers at once, eagerly, while a child process compiles the
forward; /health and /stats say how far it has come, and once it is done the steps run compiled.
A real server process and its real compiling child (`fairlane compile`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.app.conftest import wait_for
from tests.app.served_process import ServedProcess

pytestmark = pytest.mark.slow


def complete(base_url: str) -> dict[str, Any]:
    response = httpx.post(f"{base_url}/v1/completions", timeout=60,
                          json={"model": "builtin:tiny", "prompt": "Once upon a time", "max_tokens": 8,
                                "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def compile_state(base_url: str) -> dict[str, Any]:
    health = httpx.get(f"{base_url}/health", timeout=5)
    assert health.status_code == 200 and health.json()["ready"] is True  # ready while it compiles, too
    state: dict[str, Any] = health.json()["compile"]
    return state


def test_answers_while_compiling_then_runs_compiled(compile_artifacts: Path) -> None:
    # The cheapest compile that exercises it all (inductor's defaults, one decoder layer compiled for all),
    # with the block size and the one thread of tests/gpu/test_regional_compile.py: where that test runs in
    # this process after this one, it loads what this child compiled instead of compiling it again.
    env = {**os.environ, "FAIRLANE_KV_CACHE_BYTES": str(4 * 1024 * 1024), "FAIRLANE_SWAP_SPACE_BYTES": "0",
           "FAIRLANE_COMPILE_CACHE_DIR": str(compile_artifacts), "OMP_NUM_THREADS": "1"}
    served = ServedProcess(env, ["--compile", "default", "--compile-scope", "layer", "--block-size", "8"]).wait_ready()
    try:
        first = complete(served.base_url)  # no wait for the compilation
        assert first["usage"]["completion_tokens"] == 8
        assert compile_state(served.base_url)["state"] in {"compiling", "loading", "ready"}
        wait_for(lambda: compile_state(served.base_url)["state"] in {"ready", "failed"}, timeout=600, interval=0.5,
                 what="the background compilation")
        assert compile_state(served.base_url)["state"] == "ready", "".join(served.log)
        again = complete(served.base_url)
        # Greedy: the compiled forward picks the tokens the eager one did.
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        stats = httpx.get(f"{served.base_url}/stats", timeout=5).json()
        assert stats["compile"]["state"] == "ready" and stats["forward_recompilations"] == 0
        log = "".join(served.log)
        assert "background compile: warm-up step 1 of 3 done" in log
        assert "steps now run the compiled forward" in log
        # The child compiled the scope the server serves: its marker is in the folder the server loaded.
        assert list(compile_artifacts.glob("llama-layer-*/compiled-block8-threads1.json")), log
    finally:
        served.kill()
