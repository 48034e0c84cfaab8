"""Session fixtures: the models are loaded once and shared by every test that needs them."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu.models import LoadedModel, build_builtin, load_model

REPO_ROOT = Path(__file__).resolve().parent.parent

# The suite runs the forward eagerly: compiling at every server start would cost minutes. The servers
# and commands the tests start read this too; tests/gpu/test_compiled.py runs the compiled forward.
os.environ.setdefault("FAIRLANE_COMPILE_MODE", "eager")
# Every server and command a test starts runs where the test's own models do: on the CPU, even on a
# machine with a GPU (where `auto` would pick CUDA without a word). The GPU check (make gpu-check)
# sets FAIRLANE_TEST_DEVICE=cuda to run them all on the GPU instead.
TEST_DEVICE = os.environ.setdefault("FAIRLANE_DEVICE", os.environ.get("FAIRLANE_TEST_DEVICE", "cpu"))

# The test models are small: extra intra-op threads buy little and, next to the engine's worker
# thread, the event loop and any server a test starts, their spin-waits cost far more than they give.
torch.set_num_threads(1)

# Several tests poll the engine on every turn of the event loop (`wait_until(interval=0)`) so that no
# step goes by unobserved. That loop competes for the GIL with the worker thread running the forward,
# which waits up to the switch interval (5 ms by default) each time it wants the GIL back: with ~20
# operators per layer the steps of builtin:tiny then slow down tenfold. A shorter interval keeps the
# poll from starving the step.
sys.setswitchinterval(0.0005)


# Under `make test` the suite runs on two workers (pytest-xdist, `--dist loadfile`): a module is one
# unit of work, so its module fixtures (a cluster, a server, a compiled runner) are set up once.


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with slow tests first (`--no-loadscope-reorder` keeps this order): a worker that draws a
    minute-long soak last leaves the other idle meanwhile."""
    slow_modules = {module_of(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: module_of(item) not in slow_modules)  # stable: each module keeps its order


def module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """Where converted checkpoints live: the repo's own cache, so a conversion happens once per machine."""
    path = REPO_ROOT / "data" / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def compile_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder of inductor's artifacts for the whole run: a test that compiles what an earlier one
    compiled (the same model, dtype, mode and thread count) loads it instead of compiling again."""
    return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """builtin:tiny as the runner gets it, on the test device. Runners switch its attention to the paged
    path, so it is never used as a reference (`tiny_reference` stays on the CPU: tokens compare across
    devices)."""
    return load_model("builtin:tiny", device=TEST_DEVICE, dtype="float32")


@pytest.fixture(scope="session")
def tiny_reference() -> Any:
    """The same weights in a separate instance with transformers' own attention; EOS is not special,
    so generate runs to max_new_tokens like the engine does with no stop tokens."""
    model = build_builtin("tiny", seed=0).to(device="cpu", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model
