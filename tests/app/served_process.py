"""`fairlane serve` as a real process, for the tests that need one: its own signals, its own start-up,
its command line."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.app.conftest import wait_for

FAIRLANE = Path(sys.executable).with_name("fairlane")
# uvicorn's start-up line: with --port 0 it names the port the server bound.
STARTED_LINE = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


class ServedProcess:
    """`fairlane serve --model builtin:tiny --port 0` as a real process. The server binds a free port
    itself (a number picked here could be taken before it binds) and uvicorn's start-up line on
    stderr says which; a thread keeps reading stderr so that the pipe never fills."""

    def __init__(self, env: dict[str, str], args: Sequence[str] = ()) -> None:
        self.process = subprocess.Popen([str(FAIRLANE), "serve", "--model", "builtin:tiny", "--port", "0", *args],
                                        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.base_url = ""
        self._log_reader = threading.Thread(target=self._read_log, name="serve-log", daemon=True)
        self._log_reader.start()

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        with self.process.stderr:
            for line in self.process.stderr:
                self.log.append(line)
                if not self.base_url and (started := STARTED_LINE.search(line)):
                    self.base_url = started[1]

    def wait_ready(self) -> ServedProcess:
        wait_for(lambda: (self.base_url != "" and is_ready(self.base_url)) or self.process.poll() is not None,
                 timeout=60, interval=0.1, what="the server to start")
        if self.process.poll() is not None:
            self._log_reader.join(timeout=10)
        assert self.process.poll() is None, "".join(self.log)
        return self

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        self._log_reader.join(timeout=10)


def is_ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
