"""Process isolation for tests that leave global state behind (vLLM's `create_new_process_for_each_test`).

What torch.compile compiles stays with the process: dynamo's code caches and guards, its counters and
inductor's in-memory caches. A later test in the same process then reuses or counts it (a second start
that should load artifacts from disk finds them in memory instead, say). A test marked here runs in a
freshly spawned interpreter, and only its verdict comes back.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def call_in_fresh_process(function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """function(*args, **kwargs) in a new spawned process, its result returned here. An exception there is
    raised here, the child's traceback attached as its cause; a child that dies is a BrokenProcessPool.
    The function must be importable by name (module level), its arguments and result picklable."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=_set_up_child) as pool:
        result: R = pool.submit(function, *args, **kwargs).result()
    return result


def in_fresh_process(test: Callable[P, None]) -> Callable[P, None]:
    """Decorate a module-level test so that its body runs in a fresh spawned process. Fixtures are set up
    here and passed over, so their values must pickle (paths, numbers, plain data); pytest still sees the
    test's own signature."""
    @functools.wraps(test)
    def run_elsewhere(*args: P.args, **kwargs: P.kwargs) -> None:
        call_in_fresh_process(_run_undecorated, test.__module__, test.__qualname__, args, kwargs)

    return run_elsewhere


def _set_up_child() -> None:
    import tests.conftest  # noqa: F401  # the suite's process settings: eager servers, the test device, 1 thread


def _run_undecorated(module: str, qualname: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """In the child: the test as written, not its decorated self (which would spawn again)."""
    test: Any = importlib.import_module(module)
    for name in qualname.split("."):
        test = getattr(test, name)
    test.__wrapped__(*args, **kwargs)
