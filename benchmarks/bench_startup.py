"""`fairlane bench startup`: how long a new user waits. `fairlane serve` is started twice over one fresh
data folder (the model's converted weights, the compiled artifacts, the batch database all start
empty), each time measuring from launch:
- ready: /health answers 200;
- first answer: a short chat completion sent as soon as it is ready has come back whole;
- compiled: /health says the compiled forward is in use (the background compilation's end);
and the same completion's time once the forward is compiled. The second start is a restart: it finds
the first start's converted model and artifacts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

STARTED_LINE = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("startup", help="launch to first answer and to compiled: a first start, a restart")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--serve-args", default="", help="more flags for fairlane serve, as one string")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a start may take to compile")
    parser.add_argument("--out", help="write the JSON report here")
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"model": args.model, "serve_args": args.serve_args,
                              "load_average_before": os.getloadavg()[0], "starts": []}
    with tempfile.TemporaryDirectory(prefix="fairlane-bench-startup-") as folder:
        for label in ("first start", "restart"):
            report["starts"].append({"start": label, **measure_start(args, Path(folder))})
    report["load_average_after"] = os.getloadavg()[0]
    print(format_table(report["starts"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


class Server:
    """`fairlane serve --port 0` over the folder; a thread reads its log for the bound address."""

    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        env = {**os.environ, "FAIRLANE_MODEL_CACHE_DIR": str(folder / "models"),
               "FAIRLANE_COMPILE_CACHE_DIR": str(folder / "compile_cache"),
               "FAIRLANE_BATCH_DB_PATH": str(folder / "fairlane.db")}
        fairlane = Path(sys.executable).with_name("fairlane")
        self.model = args.model
        self.launched = time.monotonic()
        self.process = subprocess.Popen([str(fairlane), "serve", "--model", args.model, "--port", "0",
                                         *args.serve_args.split()], env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        self.base_url = ""
        self.log: list[str] = []
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            if not self.base_url and (started := STARTED_LINE.search(line)):
                self.base_url = started[1]

    def since_launch(self) -> float:
        return round(time.monotonic() - self.launched, 2)

    def health(self) -> dict[str, Any] | None:
        if not self.base_url:
            return None
        try:
            response = httpx.get(f"{self.base_url}/health", timeout=5)
        except httpx.TransportError:
            return None
        body: dict[str, Any] = response.json()
        return body if response.status_code == 200 else None

    def wait(self, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited while waiting for {what}:\n{''.join(self.log[-30:])}")
            health = self.health()
            if health is not None and predicate(health):
                return health
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}")

    def complete(self, max_tokens: int) -> float:
        started = time.monotonic()
        response = httpx.post(f"{self.base_url}/v1/chat/completions", timeout=600,
                              json={"model": self.model, "messages": PROMPT, "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True})
        response.raise_for_status()
        return round(time.monotonic() - started, 3)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def measure_start(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    server = Server(args, folder)
    try:
        server.wait(lambda health: True, args.timeout, "ready")
        ready_s = server.since_launch()
        answer_while_compiling_s = server.complete(args.max_tokens)
        first_answer_s = server.since_launch()
        server.wait(lambda health: health.get("compile", {"state": "ready"})["state"] in {"ready", "failed"},
                    args.timeout, "the compiled forward")
        compiled_s = server.since_launch()
        server.complete(args.max_tokens)  # its first compiled step allocates
        answer_compiled_s = server.complete(args.max_tokens)
        state = (server.health() or {}).get("compile", {"state": "ready at start-up"})["state"]
    finally:
        server.stop()
    return {"ready_s": ready_s, "first_answer_s": first_answer_s, "compiled_s": compiled_s,
            "compile_state": state, "answer_while_compiling_s": answer_while_compiling_s,
            "answer_compiled_s": answer_compiled_s}


def format_table(starts: list[dict[str, Any]]) -> str:
    lines = ["| start | ready s | first answer s | compiled s | one answer, eager s | one answer, compiled s |",
             "|---|---|---|---|---|---|"]
    for s in starts:
        lines.append(f"| {s['start']} | {s['ready_s']} | {s['first_answer_s']} | {s['compiled_s']} "
                     f"({s['compile_state']}) | {s['answer_while_compiling_s']} | {s['answer_compiled_s']} |")
    return "\n".join(lines)
