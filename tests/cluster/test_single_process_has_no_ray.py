"""Single-process `fairlane serve` never imports Ray: the command runs its real handler (the server's
run stubbed out) in a fresh interpreter, which then looks at what it imported."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import app.process.server
app.process.server.DrainingServer.run = lambda self, sockets=None: None
from benchmarks.cli import main
assert main(["serve", "--model", "builtin:tiny", "--port", "0"]) == 0
loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith(("ray.", "cluster.")) and m != "cluster.cli")
print(loaded)
"""


def test_fairlane_serve_without_replicas_never_imports_ray() -> None:
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)

    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().splitlines()[-1] == "[]"
