"""`fairlane bench stream`: the HTTP + SSE path alone, at 1, 16, 64 and 256 concurrent streams.

The server is fairlane's own app on uvicorn over loopback, in a process of its own, with an
executor that costs nothing (`benchmarks.fake_executors.InstantExecutor`) and the byte tokenizer. So what is
measured is everything but the model: engine loop, scheduler, detokenization, stop-string checks,
JSON and SSE framing, HTTP. The clients are httpx async streams in this process, so their CPU is
not counted as the server's. Per level: streamed tokens/s, SSE events/s, and the server's CPU time
per token (psutil: user + system, all its threads).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import psutil

from app.process.engine_factory import scheduler_config_of
from app.process.server import DrainingServer, uvicorn_config
from app.serving.context import ServingContext
from benchmarks.fake_executors import InstantExecutor, instant_geometry
from config.settings import Settings, load_settings
from gpu.tokenizer import ByteTokenizer
from loadtest.bench_output import format_table, write_report
from scheduling.engine import Engine
from scheduling.scheduler import Scheduler

MiB = 1024 * 1024
MODEL_NAME = "instant"
PROMPT = "Stream me a story about a fox, a dog and a café."
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


@dataclass(slots=True, frozen=True)
class StreamBenchOptions:
    concurrency: tuple[int, ...]
    duration_s: float  # each client keeps opening streams until this has passed, then finishes its last
    max_tokens: int  # tokens per stream
    coalesce_modes: tuple[bool, ...]
    stream_intervals: tuple[int, ...] = (1,)  # the server's stream_interval (tokens a stream sends at once)


@dataclass(slots=True)
class LevelResult:
    coalesce: bool
    stream_interval: int
    concurrency: int
    num_streams: int
    num_tokens: int
    num_events: int  # SSE data events, [DONE] excluded
    num_steps: int  # engine steps: tokens per step is how many streams the server really ran at once
    wall_s: float
    server_cpu_s: float
    client_cpu_s: float  # this process: when it nears 1 s per second, the clients are the bottleneck

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s

    @property
    def cpu_us_per_token(self) -> float:
        return 1e6 * self.server_cpu_s / self.num_tokens if self.num_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1),
                "events_per_s": round(self.num_events / self.wall_s, 1),
                "server_cpu_us_per_token": round(self.cpu_us_per_token, 2),
                "server_cpu_utilization": round(self.server_cpu_s / self.wall_s, 3),
                "client_cpu_utilization": round(self.client_cpu_s / self.wall_s, 3)}


# ---- the server process --------------------------------------------------------------------------


def build_instant_engine(settings: Settings, max_model_len: int = 4096) -> tuple[Engine, ByteTokenizer]:
    """An engine (not started) over an InstantExecutor, and the byte tokenizer its output is read with."""
    executor = InstantExecutor(instant_geometry(settings, max_model_len))
    scheduler = Scheduler(scheduler_config_of(settings), executor.geometry)
    return Engine(scheduler, executor, max_queued_requests=settings.max_queued_requests), ByteTokenizer()


def serve_instant(listener_fd: int, coalesce: bool, stream_interval: int = 1) -> None:
    """Run the real app on an instant engine until SIGTERM (this is the server process), on the
    listening socket the parent bound and handed down."""
    settings = load_settings(environ={}, overrides={
        "model": MODEL_NAME, "port": 0, "max_num_seqs": 1024, "max_num_batched_tokens": 8192,
        "max_queued_requests": 4096, "kv_cache_bytes": 256 * MiB, "shutdown_grace_s": 1.0,
        "stream_coalesce": coalesce, "stream_interval": stream_interval})
    engine, tokenizer = build_instant_engine(settings)
    context = ServingContext(settings, engine, tokenizer)
    config = uvicorn_config(context, access_log=False, log_level="warning")
    # While a level warms up, streams that finished first leave their connections idle until the
    # slowest one ends; past uvicorn's 5 s default the server would close them under the client.
    config.timeout_keep_alive = 120
    DrainingServer(config, context).run(sockets=[socket.socket(fileno=listener_fd)])


@contextmanager
def server_process(coalesce: bool, stream_interval: int = 1) -> Iterator[tuple[str, psutil.Process]]:
    # The socket is bound and listening here, then handed to the server process: no other process
    # can take the port between choosing it and serving on it.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(2048)
        port = listener.getsockname()[1]
        command = [sys.executable, "-m", "benchmarks.bench_stream", "--serve-fd", str(listener.fileno()),
                   "--serve-coalesce", "on" if coalesce else "off", "--serve-stream-interval", str(stream_interval)]
        process = subprocess.Popen(command, pass_fds=(listener.fileno(),),
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_ready(base_url, process)
        yield base_url, psutil.Process(process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_ready(base_url: str, process: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the bench server exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the bench server did not become ready")


# ---- the clients ---------------------------------------------------------------------------------


@dataclass(slots=True)
class ClientTally:
    num_streams: int = 0
    num_tokens: int = 0
    num_events: int = 0


async def _one_stream(client: httpx.AsyncClient, body: dict[str, Any], tally: ClientTally) -> None:
    tail = b""
    num_events = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for chunk in response.aiter_raw():
            num_events += chunk.count(b"data: ")
            tail = (tail + chunk)[-512:]
    match = _COMPLETION_TOKENS.search(tail)
    if not tail.endswith(b"data: [DONE]\n\n") or match is None:
        raise RuntimeError(f"a stream ended without usage and [DONE]: {tail[-200:]!r}")
    tally.num_streams += 1
    tally.num_tokens += int(match.group(1))
    tally.num_events += num_events - 1  # [DONE] is not an event with tokens


async def _client_loop(client: httpx.AsyncClient, body: dict[str, Any], deadline: float,
                       tally: ClientTally) -> None:
    while time.perf_counter() < deadline:
        await _one_stream(client, body, tally)


def _stream_body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


async def run_level(base_url: str, server: psutil.Process, concurrency: int, options: StreamBenchOptions,
                    coalesce: bool, stream_interval: int = 1) -> LevelResult:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    body = _stream_body(options.max_tokens)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
        warmup = ClientTally()
        await asyncio.gather(*(_one_stream(client, body, warmup) for _ in range(concurrency)))
        tally = ClientTally()
        steps_before = await _engine_steps(client)
        cpu_before = _cpu_seconds(server)
        client_cpu_before = time.process_time()
        started = time.perf_counter()
        deadline = started + options.duration_s
        await asyncio.gather(*(_client_loop(client, body, deadline, tally) for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
        server_cpu_s = _cpu_seconds(server) - cpu_before
        client_cpu_s = time.process_time() - client_cpu_before
        num_steps = await _engine_steps(client) - steps_before
    return LevelResult(coalesce, stream_interval, concurrency, tally.num_streams, tally.num_tokens, tally.num_events,
                       num_steps, wall_s, server_cpu_s, client_cpu_s)


async def _engine_steps(client: httpx.AsyncClient) -> int:
    response = await client.get("/stats")
    response.raise_for_status()
    return int(response.json()["steps"])


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def run_bench(options: StreamBenchOptions) -> list[LevelResult]:
    results = []
    for coalesce in options.coalesce_modes:
        for interval in options.stream_intervals:
            with server_process(coalesce, interval) as (base_url, server):
                for concurrency in options.concurrency:
                    result = asyncio.run(run_level(base_url, server, concurrency, options, coalesce, interval))
                    print(f"coalesce={'on' if coalesce else 'off'} interval={interval} streams={concurrency}: "
                          f"{result.tokens_per_s:,.0f} tokens/s", file=sys.stderr)
                    results.append(result)
    return results


# ---- report and command --------------------------------------------------------------------------


def results_table(results: Sequence[LevelResult]) -> str:
    rows = [["coalesce", "interval", "streams", "tokens/s", "events/s", "tokens/event", "tokens/step",
             "server CPU us/token", "server CPU", "client CPU"]]
    for r in results:
        rows.append(["on" if r.coalesce else "off", str(r.stream_interval), str(r.concurrency),
                     f"{r.tokens_per_s:,.0f}",
                     f"{r.num_events / r.wall_s:,.0f}", f"{r.num_tokens / max(r.num_events, 1):.2f}",
                     f"{r.num_tokens / max(r.num_steps, 1):.1f}",
                     f"{r.cpu_us_per_token:.1f}", f"{100 * r.server_cpu_s / r.wall_s:.0f}%",
                     f"{100 * r.client_cpu_s / r.wall_s:.0f}%"])
    return format_table(rows)


def report_json(options: StreamBenchOptions, results: Sequence[LevelResult]) -> dict[str, Any]:
    return {"bench": "stream", "machine": {"platform": platform.platform(), "python": platform.python_version(),
                                           "cpu_count": os.cpu_count()},
            "options": {**asdict(options)}, "results": [r.to_json() for r in results]}


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("stream", help="HTTP + SSE streaming throughput with a zero-cost model")
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated concurrent streams")
    parser.add_argument("--duration-s", type=float, default=3.0, help="time each level keeps opening streams")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per stream")
    parser.add_argument("--coalesce", choices=["on", "off", "both"], default="both",
                        help="send a stream's pending tokens as one event (the stream_coalesce setting)")
    parser.add_argument("--stream-interval", default="1",
                        help="comma-separated values of the server's stream_interval, one server each")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.coalesce]
    options = StreamBenchOptions(tuple(int(c) for c in args.concurrency.split(",")), args.duration_s,
                                 args.max_tokens, modes, tuple(int(i) for i in args.stream_interval.split(",")))
    results = run_bench(options)
    print(results_table(results))
    write_report(args.out, report_json(options, results))
    return 0


def _serve_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description="the bench server process (started by `fairlane bench stream`)")
    parser.add_argument("--serve-fd", type=int, required=True, help="a listening socket inherited from the parent")
    parser.add_argument("--serve-coalesce", choices=["on", "off"], required=True)
    parser.add_argument("--serve-stream-interval", type=int, default=1)
    args = parser.parse_args(argv)
    serve_instant(args.serve_fd, args.serve_coalesce == "on", args.serve_stream_interval)
    return 0


if __name__ == "__main__":
    sys.exit(_serve_main(sys.argv[1:]))
