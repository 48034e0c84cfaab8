"""The import graph has no cycle, lazy imports included.

import-linter's contracts (pyproject.toml) keep the layers: benchmarks on top and imported only by the
tests, loadtest HTTP-only. What they cannot say is that no module imports, directly or through
others, something that imports it back; an import inside a function would hide such a circle at run
time until the day the order changes. grimp reads every import statement, so it sees those too.
"""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("app", "contract", "scheduling", "tenancy", "gpu", "config", "loadtest", "benchmarks", "cluster")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def test_no_module_imports_itself_back(graph: grimp.ImportGraph) -> None:
    in_cycles = {module: sorted(graph.find_upstream_modules(module) & graph.find_downstream_modules(module))
                 for module in sorted(graph.modules)}
    assert {module: others for module, others in in_cycles.items() if others} == {}


def test_the_commands_are_in_the_graph(graph: grimp.ImportGraph) -> None:
    """The test above checks something: the modules the `fairlane` command is built from are there."""
    assert {"app.process.cli", "app.process.server", "app.process.flags", "benchmarks.cli"} <= graph.modules
    assert graph.direct_import_exists(importer="app.process.cli", imported="app.process.server")
    assert graph.direct_import_exists(importer="benchmarks.cli", imported="app.process.cli")
