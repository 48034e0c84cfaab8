"""Serving while compiling: the forward is compiled in a child process while the runner serves eagerly.

A first start used to compile for minutes before it answered. Now the runner starts eager, and:
1. a child process (`fairlane compile`, started by the app with the server's settings) compiles the
   forward into the artifact folder, printing a JSON line per warm-up step (`ProgressLine`);
2. when the child is done, a thread of this process builds the compiled forward again, over a scratch
   KV pool of a few blocks: every graph is now found in inductor's caches, so this is a load, not a
   compilation (seconds, against minutes);
3. the runner takes the compiled forward at the start of its next step (`take_ready`), between two
   steps, on its own thread.

The compilation runs in another process, not a thread of this one: inductor's lowering is Python
holding the GIL for minutes, and every eager step (hundreds of small ops, each giving the GIL up)
would wait on it. A child also keeps dynamo's state out of the serving process, and is what
`fairlane compile` runs to warm the cache ahead of time. When the child fails, the runner goes on
eagerly and the status says why; when the server stops, the child is stopped with it (it also exits
on its own when its stdin closes, so a killed server leaves no compiler behind).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import IO, Any, Literal

from gpu.compiled import PackedForward

logger = logging.getLogger(__name__)

LOAD_SWITCH_INTERVAL_S = 0.0005

CompileState = Literal["compiling", "loading", "ready", "failed", "stopped"]


@dataclass(slots=True, frozen=True)
class CompileStatus:
    """Where the background compilation stands, for the log, /health and /stats."""

    state: CompileState
    step: int = 0  # warm-up steps the child has finished
    num_steps: int = 0  # 0 until the child has said how many
    started_at: float = 0.0  # time.monotonic() when the child started
    finished_at: float | None = None  # when the compiled forward was ready, or the compilation failed
    error: str | None = None

    def describe(self) -> str:
        if self.state == "compiling":
            of = f" of {self.num_steps}" if self.num_steps else ""
            return f"compiling, step {self.step + 1}{of}"
        if self.state == "failed":
            return f"compilation failed: {self.error}"
        return self.state

    def as_json(self) -> dict[str, Any]:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return {"state": self.state, "step": self.step, "num_steps": self.num_steps,
                "seconds": round(end - self.started_at, 1), "error": self.error, "message": self.describe()}


def progress_line(**fields: Any) -> str:
    """One line of the child's progress on its stdout: `{"step": k, "num_steps": n, "label": ...}` after
    each warm-up step, `{"done": true, ...}` at the end."""
    return json.dumps(fields, separators=(",", ":"))


class BackgroundCompile:
    """Runs the compiling child, follows its progress, then loads its artifacts with `load` in a thread
    (or, with `load_on_step_thread`, in the runner's next step: LoRA adapters keep per-step state on the
    model that a second thread's forward would overwrite)."""

    def __init__(self, command: Sequence[str] | None, load: Callable[[], PackedForward], *,
                 load_on_step_thread: bool = False) -> None:
        """command: the compiling child; None when the artifacts are on disk already (only the load runs)."""
        self._load = load
        self._load_on_step_thread = load_on_step_thread
        self._lock = threading.Lock()
        self._status = CompileStatus("compiling", started_at=time.monotonic())
        self._ready: PackedForward | None = None
        self._load_due = False
        self._is_closing = False
        self._command = command
        self._child: subprocess.Popen[str] | None = None
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Start compiling (or loading). Called once the server is up: a load in a thread of this process
        competes for the GIL, and the server's own start-up would wait on it."""
        if self._watcher is not None:
            return
        self._status = CompileStatus("compiling", started_at=time.monotonic())
        if self._command is None:
            logger.info("serving eagerly while the compiled forward loads from its artifacts")
            self._set(state="loading")
            self._watcher = threading.Thread(target=self._hand_over, name="fairlane-compile-load", daemon=True)
        else:
            logger.info("serving eagerly while a child process compiles the forward: %s", " ".join(self._command))
            # stderr is inherited: the child's own log lines land in the server's log.
            self._child = subprocess.Popen(list(self._command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           text=True)
            self._watcher = threading.Thread(target=self._follow, name="fairlane-compile-watch", daemon=True)
        self._watcher.start()

    @property
    def status(self) -> CompileStatus:
        return self._status

    def take_ready(self) -> PackedForward | None:
        """The compiled forward once, when it is ready; call it on the runner's thread between steps."""
        with self._lock:
            if self._load_due and self._load_on_step_thread:
                self._load_due = False
                self._run_load()
            ready, self._ready = self._ready, None
            return ready

    def close(self) -> None:
        """Stop the child if it still runs (the server is stopping)."""
        self._is_closing = True
        if self._child is not None and self._child.poll() is None:
            self._child.terminate()
            try:
                self._child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._child.kill()
        if self._child is not None and self._watcher is not None and threading.current_thread() is not self._watcher:
            self._watcher.join(timeout=30)  # it closes the child's pipes

    def _follow(self) -> None:
        assert self._child is not None
        stdout, stdin = self._child.stdout, self._child.stdin
        assert stdout is not None and stdin is not None
        with stdout:
            self._read_progress(stdout)
        code = self._child.wait()
        stdin.close()
        if self._is_closing:
            self._set(state="stopped", finished_at=time.monotonic())
            return
        if code != 0:
            self._fail(f"the compiling process exited with status {code}")
            return
        self._set(state="loading")
        logger.info("the child process compiled the forward in %.0f s; loading its artifacts",
                    time.monotonic() - self._status.started_at)
        self._hand_over()

    def _hand_over(self) -> None:
        """Load the artifacts here, or leave the load to the runner's next step."""
        if self._load_on_step_thread:
            with self._lock:
                self._load_due = True
        else:
            self._run_load()

    def _read_progress(self, stdout: IO[str]) -> None:
        for line in stdout:
            try:
                fields = json.loads(line)
            except ValueError:
                continue  # not ours: a library printing to stdout
            if isinstance(fields, dict) and "step" in fields:
                self._set(step=int(fields["step"]), num_steps=int(fields["num_steps"]))
                logger.info("background compile: warm-up step %d of %d done (%s), %.0f s so far",
                            fields["step"], fields["num_steps"], fields.get("label", ""),
                            time.monotonic() - self._status.started_at)

    def _run_load(self) -> None:
        # The load is seconds of Python (dynamo traces the model again) holding the GIL, and every eager
        # op of the runner's thread gives the GIL up and waits for it again: a shorter switch interval
        # bounds each wait (SmolLM2, a 32-token answer during the load: 29.6 s at CPython's 5 ms).
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, LOAD_SWITCH_INTERVAL_S))
        try:
            forward = self._load()
        except Exception as exc:  # the runner goes on eagerly: a failed compile must not stop serving
            logger.exception("loading the compiled forward failed")
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        finally:
            sys.setswitchinterval(interval)
        self._ready = forward
        self._set(state="ready", finished_at=time.monotonic())
        logger.info("the compiled forward is ready, %.0f s after start-up (%d graphs, loaded in %.1f s); the next "
                    "step uses it", time.monotonic() - self._status.started_at, forward.num_graphs,
                    forward.compile_seconds)

    def _fail(self, error: str) -> None:
        logger.error("the background compilation failed, serving stays eager: %s", error)
        self._set(state="failed", finished_at=time.monotonic(), error=error)

    def _set(self, **changes: Any) -> None:
        self._status = replace(self._status, **changes)


def exit_with_parent() -> None:
    """In the child: exit when the parent closes our stdin (it stopped, or was killed)."""

    def watch() -> None:
        sys.stdin.read()
        logger.warning("the serving process is gone: stopping the compilation")
        os._exit(3)

    threading.Thread(target=watch, name="fairlane-parent-watch", daemon=True).start()
