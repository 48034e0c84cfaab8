"""`fairlane bench preemption`: interactive requests arriving over a batch backlog that saturates the engine.

The same seeded traffic runs on fresh engines over one loaded model:
- `interactive_alone`: only the interactive requests (Poisson arrivals): their latency with the engine
  to themselves, and the share of the time the engine is busy serving them;
- `batch_alone`: only the batch backlog, for as long as `interactive_alone` lasted: the batch capacity;
- `fcfs`: both, every request in the interactive class with first-come-first-served order (no priority);
- `priority_swap`: both, batch requests in the batch class, preempted by swap for interactive ones;
- `priority_swap_budget`: the same with step shaping, which keeps each step's predicted time within
  the interactive target while interactive requests are active (scheduling/step_shaper.py).

The backlog is `--backlog` batch requests kept in flight (a finished one is replaced at once), more
than the KV memory holds, so the engine always has batch work queued. The clock starts once the
backlog has produced 8 tokens per lane (past its first wave of prefills); a run ends when its last
interactive request ends, and the batch requests still in flight are then aborted. Batch tokens/s
counts the batch tokens received inside that window.

Targets, for priority, swap and the step budget: interactive TTFT p99 and ITL p50 and p99 each at
most 1.3x the same percentile alone; batch tokens/s at least 80% of the capacity interactive leaves
unused, measured as batch-alone tokens/s x (1 - the busy share of the interactive-alone run), where
the busy share is the engine's step time (schedule, forward, update) over that run's window; and
the step cost model's median absolute error at most 15%.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.process.engine_factory import build_engine, load_model_for
from app.process.flags import MODEL_FLAG_KEYS, add_model_flags
from benchmarks.common import BenchRequest
from config.settings import MiB, Settings, load_settings
from loadtest.bench_output import format_table, write_report
from loadtest.stats import percentile
from scheduling.engine import Engine, RequestStream
from scheduling.gc_pacing import paced_collection
from scheduling.request import PriorityClass, Request, RequestId

LATENCY_MAX_RATIO = 1.3  # TTFT p99, ITL p50 and ITL p99, each against the same percentile alone
COST_MODEL_MAX_ERROR = 0.15
BATCH_CAPACITY_MIN_FRACTION = 0.8
BIN_S = 0.5  # timeline resolution
WARMUP_TOKENS_PER_LANE = 8  # batch tokens received before the clock starts: past the first wave of prefills


@dataclass(slots=True, frozen=True)
class Traffic:
    """The seeded traffic: Poisson interactive arrivals and an endless stream of batch requests."""

    seed: int
    duration_s: float  # interactive requests arrive during this long
    interactive_rate: float  # arrivals per second
    interactive_prompt_len: tuple[int, int]
    interactive_output_len: tuple[int, int]
    batch_prompt_len: tuple[int, int]
    batch_output_len: tuple[int, int]
    backlog: int  # batch requests kept in flight


@dataclass(slots=True, frozen=True)
class Arrival:
    at_s: float  # seconds after the clock starts
    request: BenchRequest


def draw(rng: random.Random, prompt_len: tuple[int, int], output_len: tuple[int, int]) -> BenchRequest:
    prompt = [rng.randrange(256) for _ in range(rng.randint(*prompt_len))]
    return BenchRequest(prompt, rng.randint(*output_len))


def interactive_arrivals(traffic: Traffic) -> list[Arrival]:
    rng = random.Random(traffic.seed)
    arrivals, at = [], rng.expovariate(traffic.interactive_rate)
    while at < traffic.duration_s:
        arrivals.append(Arrival(at, draw(rng, traffic.interactive_prompt_len, traffic.interactive_output_len)))
        at += rng.expovariate(traffic.interactive_rate)
    return arrivals


def batch_stream(traffic: Traffic) -> Iterator[BenchRequest]:
    rng = random.Random(traffic.seed + 1)
    while True:
        yield draw(rng, traffic.batch_prompt_len, traffic.batch_output_len)


@dataclass(slots=True, frozen=True)
class RunSpec:
    name: str
    interactive: bool
    batch: bool
    overrides: dict[str, Any]  # settings of this run on top of the bench's
    batch_class: PriorityClass = PriorityClass.BATCH  # fcfs puts batch requests in the interactive class


RUNS = (
    RunSpec("interactive_alone", True, False, {}),
    RunSpec("batch_alone", False, True, {}),
    RunSpec("fcfs", True, True, {"queue_policy": "fcfs", "step_shaping": False}, batch_class=PriorityClass.INTERACTIVE),
    RunSpec("priority_swap", True, True, {"preemption_mode": "swap", "step_shaping": False}),
    RunSpec("priority_swap_budget", True, True, {"preemption_mode": "swap", "step_shaping": True}),
)


@dataclass(slots=True)
class RunTrace:
    """What one run observed; times in seconds after its clock started."""

    name: str
    window_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)  # per interactive request
    itl_s: list[float] = field(default_factory=list)  # gaps between tokens of one interactive request
    interactive_token_times: list[float] = field(default_factory=list)
    batch_token_times: list[float] = field(default_factory=list)
    preemption_times: list[float] = field(default_factory=list)
    busy_s: float = 0.0  # the engine's step time inside the window
    stats: dict[str, Any] = field(default_factory=dict)


# ---- driving one engine ----------------------------------------------------------------------------


class Driver:
    """Submits the traffic of one run to one started engine and records when each token arrives."""

    def __init__(self, engine: Engine, spec: RunSpec, traffic: Traffic) -> None:
        self.engine = engine
        self.spec = spec
        self.traffic = traffic
        self.trace = RunTrace(spec.name)
        self.t0 = time.perf_counter()
        self._batch = batch_stream(traffic)
        self._ids = itertools.count()
        self._open: set[RequestStream] = set()
        self._stopping = False

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def submit(self, req: BenchRequest, priority: PriorityClass) -> RequestStream:
        request = Request(RequestId(f"{priority.value}-{next(self._ids)}"), list(req.prompt_token_ids),
                          req.num_output_tokens, priority=priority)
        return self.engine.submit(request)

    async def batch_lane(self) -> None:
        while not self._stopping:
            stream = self.submit(next(self._batch), self.spec.batch_class)
            self._open.add(stream)
            async for event in stream:
                self.trace.batch_token_times.extend(self.now() for _ in event.new_token_ids)
            self._open.discard(stream)

    async def interactive_request(self, arrival: Arrival) -> None:
        await asyncio.sleep(max(0.0, arrival.at_s - self.now()))
        submitted = self.now()
        times: list[float] = []
        async for event in self.submit(arrival.request, PriorityClass.INTERACTIVE):
            times.extend(self.now() for _ in event.new_token_ids)
        self.trace.interactive_token_times.extend(times)
        if times:
            self.trace.ttft_s.append(times[0] - submitted)
            self.trace.itl_s.extend(b - a for a, b in itertools.pairwise(times))

    async def watch_preemptions(self) -> None:
        seen = 0
        while True:
            total = sum(self.engine.scheduler.counters.preemptions.values())
            self.trace.preemption_times.extend(self.now() for _ in range(total - seen))
            seen = total
            await asyncio.sleep(0.01)

    async def run(self, window_s: float) -> RunTrace:
        """Start the backlog, start the clock once it decodes, then the interactive arrivals (or wait
        window_s without them); abort the backlog at the end."""
        lanes = [asyncio.create_task(self.batch_lane()) for _ in range(self.traffic.backlog if self.spec.batch else 0)]
        while lanes and len(self.trace.batch_token_times) < WARMUP_TOKENS_PER_LANE * self.traffic.backlog:
            await asyncio.sleep(0.005)
        self.t0, busy_before = time.perf_counter(), self.engine.times.busy_seconds
        self.trace.batch_token_times.clear()
        watcher = asyncio.create_task(self.watch_preemptions())
        if self.spec.interactive:
            arrivals = interactive_arrivals(self.traffic)
            await asyncio.gather(*(self.interactive_request(a) for a in arrivals))
            window_s = max(self.trace.interactive_token_times, default=0.0)
        else:
            await asyncio.sleep(window_s)
        self.trace.window_s = window_s
        self.trace.busy_s = self.engine.times.busy_seconds - busy_before
        watcher.cancel()
        self._stopping = True
        for stream in list(self._open):
            stream.close()
        await asyncio.gather(*lanes, watcher, return_exceptions=True)
        self.trace.stats = self.engine.stats()
        return self.trace


async def drive(engine: Engine, spec: RunSpec, traffic: Traffic, window_s: float) -> RunTrace:
    await engine.start()
    try:
        warmup = Request(RequestId("warmup"), list(range(16)), 4)
        async for _ in engine.submit(warmup):
            pass
        return await Driver(engine, spec, traffic).run(window_s)
    finally:
        await engine.shutdown()


def run_all(overrides: dict[str, Any], traffic: Traffic, config_file: str | None = None,
            runs: Sequence[RunSpec] = RUNS, gc_as_served: bool = False) -> tuple[Settings, dict[str, RunTrace]]:
    """Every run in order, on one loaded model; the batch-alone window is the interactive-alone one."""
    base = load_settings(config_file, overrides=overrides)
    loaded = load_model_for(base)
    traces: dict[str, RunTrace] = {}
    with paced_collection() if gc_as_served else contextlib.nullcontext():  # as `fairlane serve` does
        for spec in runs:
            settings = load_settings(config_file, overrides={**overrides, **spec.overrides})
            engine, _ = build_engine(settings, loaded)
            window = traces["interactive_alone"].window_s if "interactive_alone" in traces else traffic.duration_s
            traces[spec.name] = asyncio.run(drive(engine, spec, traffic, window))
    return base, traces


# ---- the report ----------------------------------------------------------------------------------


def summarize(trace: RunTrace) -> dict[str, Any]:
    window = trace.window_s
    batch_tokens = sum(1 for t in trace.batch_token_times if t <= window)
    stats = trace.stats
    return {
        "window_s": window,
        "interactive": {"requests": len(trace.ttft_s),
                        "ttft_p50_s": percentile(trace.ttft_s, 50), "ttft_p99_s": percentile(trace.ttft_s, 99),
                        "itl_p50_s": percentile(trace.itl_s, 50), "itl_p99_s": percentile(trace.itl_s, 99)},
        "batch": {"tokens": batch_tokens, "tokens_per_s": batch_tokens / window if window > 0 else 0.0},
        "busy_share": trace.busy_s / window if window > 0 else 0.0,
        "preemptions": stats.get("preemptions", {}),
        "swapped_out_bytes": stats.get("swap", {}).get("bytes_out", 0),
        "step_cost": stats.get("step_cost", {}),
    }


def timeline(trace: RunTrace) -> dict[str, Any]:
    """Tokens per second per class in whole BIN_S bins of the window, and the preemption times."""
    num_bins = max(1, int(trace.window_s / BIN_S))

    def rate(times: Sequence[float]) -> list[float]:
        counts = [0] * num_bins
        for t in times:
            if 0 <= t < num_bins * BIN_S:
                counts[int(t / BIN_S)] += 1
        return [c / BIN_S for c in counts]

    return {"bin_s": BIN_S, "interactive_tokens_per_s": rate(trace.interactive_token_times),
            "batch_tokens_per_s": rate(trace.batch_token_times),
            "preemption_times_s": [round(t, 3) for t in trace.preemption_times if t <= trace.window_s]}


def judge(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The capacity interactive leaves to batch, each shared run against it and against interactive
    alone, and whether the step-budget run meets the targets."""
    alone, batch_alone = runs.get("interactive_alone"), runs.get("batch_alone")
    if alone is None or batch_alone is None:
        return {}
    busy = alone["busy_share"]
    capacity = batch_alone["batch"]["tokens_per_s"] * (1 - busy)
    compared = {name: against_alone(runs[name], alone, capacity)
                for name in ("priority_swap", "priority_swap_budget") if name in runs}
    verdict: dict[str, Any] = {
        "capacity": {"batch_alone_tokens_per_s": batch_alone["batch"]["tokens_per_s"],
                     "interactive_busy_share": busy, "batch_capacity_tokens_per_s": capacity,
                     "how": "batch-alone tokens/s x (1 - busy share of interactive alone), busy share = "
                            "engine step time / window"},
        "runs": compared, "latency_ratio_max": LATENCY_MAX_RATIO,
        "batch_capacity_fraction_min": BATCH_CAPACITY_MIN_FRACTION, "cost_model_error_max": COST_MODEL_MAX_ERROR,
    }
    ours = compared.get("priority_swap_budget")
    if ours is not None:
        verdict["met"] = targets_met(ours)
    return verdict


def against_alone(run: dict[str, Any], alone: dict[str, Any], capacity: float) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        ours, base = run["interactive"][key], alone["interactive"][key]
        return ours / base if base and ours is not None else None

    return {"ttft_p99_ratio": ratio("ttft_p99_s"), "itl_p50_ratio": ratio("itl_p50_s"),
            "itl_p99_ratio": ratio("itl_p99_s"),
            "batch_capacity_fraction": run["batch"]["tokens_per_s"] / capacity if capacity > 0 else None,
            "cost_model_median_error": run.get("step_cost", {}).get("median_error")}


def targets_met(compared: dict[str, Any]) -> dict[str, bool]:
    def within(value: float | None, limit: float) -> bool:
        return value is not None and value <= limit

    fraction = compared["batch_capacity_fraction"]
    return {"ttft_p99": within(compared["ttft_p99_ratio"], LATENCY_MAX_RATIO),
            "itl_p50": within(compared["itl_p50_ratio"], LATENCY_MAX_RATIO),
            "itl_p99": within(compared["itl_p99_ratio"], LATENCY_MAX_RATIO),
            "batch_capacity": fraction is not None and fraction >= BATCH_CAPACITY_MIN_FRACTION,
            "cost_model_error": within(compared["cost_model_median_error"], COST_MODEL_MAX_ERROR)}


def build_report(settings: Settings, traffic: Traffic, traces: dict[str, RunTrace]) -> dict[str, Any]:
    runs = {name: summarize(trace) for name, trace in traces.items()}
    return {
        "benchmark": "preemption",
        "config": {"model": settings.model, "device": settings.device, "dtype": settings.dtype,
                   "block_size": settings.block_size, "kv_cache_bytes": settings.kv_cache_bytes,
                   "swap_space_bytes": settings.swap_space_bytes, "max_num_seqs": settings.max_num_seqs,
                   "max_num_batched_tokens": settings.max_num_batched_tokens},
        "traffic": {"seed": traffic.seed, "duration_s": traffic.duration_s,
                    "interactive_rate": traffic.interactive_rate,
                    "interactive_requests": len(interactive_arrivals(traffic)),
                    "interactive_prompt_len": list(traffic.interactive_prompt_len),
                    "interactive_output_len": list(traffic.interactive_output_len),
                    "batch_prompt_len": list(traffic.batch_prompt_len),
                    "batch_output_len": list(traffic.batch_output_len), "backlog": traffic.backlog},
        "runs": runs,
        "targets": judge(runs),
        "timeline": {name: timeline(trace) for name, trace in traces.items()},
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def render_table(report: dict[str, Any]) -> str:
    rows = [["run", "interactive", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "batch tok/s",
             "preemptions", "swapped MiB"]]
    for name, run in report["runs"].items():
        inter, preemptions = run["interactive"], run["preemptions"]
        rows.append([name, str(inter["requests"]), _ms(inter["ttft_p50_s"]), _ms(inter["ttft_p99_s"]),
                     _ms(inter["itl_p50_s"]), _ms(inter["itl_p99_s"]), f"{run['batch']['tokens_per_s']:.1f}",
                     f"{preemptions.get('swap', 0)} swap, {preemptions.get('recompute', 0)} recompute",
                     f"{run['swapped_out_bytes'] / MiB:.1f}"])
    lines = [format_table(rows)]
    targets = report["targets"]
    if targets:
        cap = targets["capacity"]
        lines.append(f"batch capacity left by interactive: {cap['batch_capacity_tokens_per_s']:.1f} tok/s "
                     f"= batch alone {cap['batch_alone_tokens_per_s']:.1f} tok/s x (1 - interactive busy share "
                     f"{cap['interactive_busy_share']:.2f})")
        lines.append(format_table(ratio_rows(targets)))
    return "\n".join(lines)


def ratio_rows(targets: dict[str, Any]) -> list[list[str]]:
    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    limit = f"<= {LATENCY_MAX_RATIO}"
    rows = [["run", f"TTFT p99 / alone ({limit})", f"ITL p50 / alone ({limit})", f"ITL p99 / alone ({limit})",
             f"batch / capacity (>= {BATCH_CAPACITY_MIN_FRACTION})", f"cost model error (<= {COST_MODEL_MAX_ERROR})"]]
    for name, run in targets["runs"].items():
        rows.append([name, show(run["ttft_p99_ratio"]), show(run["itl_p50_ratio"]), show(run["itl_p99_ratio"]),
                     show(run["batch_capacity_fraction"]), show(run["cost_model_median_error"])])
    met = targets.get("met")
    if met:
        rows.append(["targets met", *("yes" if met[k] else "NO" for k in
                                      ("ttft_p99", "itl_p50", "itl_p99", "batch_capacity", "cost_model_error"))])
    return rows


def plot_timeline(report: dict[str, Any], path: Path) -> None:
    """Tokens/s per class over time, one panel per run, preemptions as ticks along the bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = report["timeline"]
    fig, axes = plt.subplots(len(lines), 1, figsize=(10, 2.4 * len(lines)), sharex=True, squeeze=False)
    for ax, (name, line) in zip(axes[:, 0], lines.items(), strict=True):
        times = [i * line["bin_s"] for i in range(len(line["batch_tokens_per_s"]))]
        ax.step(times, line["interactive_tokens_per_s"], where="post", label="interactive", color="tab:red")
        ax.step(times, line["batch_tokens_per_s"], where="post", label="batch", color="tab:blue")
        preemptions = line["preemption_times_s"]
        if preemptions:
            ax.plot(preemptions, [0] * len(preemptions), "|", color="black", markersize=12, label="preemption")
        ax.set_title(name, loc="left", fontsize=10)
        ax.set_ylabel("tokens/s")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the clock started")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the command ---------------------------------------------------------------------------------


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"bad length range '{text}'")
    return bounds


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("preemption", help="interactive latency and batch throughput with priority "
                                                      "and swap preemption, against FCFS and each class alone")
    add_model_flags(parser)
    parser.set_defaults(model="builtin:small", dtype="float32", max_num_seqs=32, max_num_batched_tokens=256,
                        kv_cache_bytes=64 * MiB, handler=run_command)
    parser.add_argument("--swap-space-bytes", type=int, help="the CPU swap pool (default: the settings')")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and of every prompt")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds during which interactive requests "
                                                                      "arrive")
    parser.add_argument("--interactive-rate", type=float, default=0.5, help="interactive arrivals per second")
    parser.add_argument("--interactive-prompt-len", type=_length_range, default=(32, 96), help="MIN:MAX")
    parser.add_argument("--interactive-output-len", type=_length_range, default=(16, 32), help="MIN:MAX")
    parser.add_argument("--batch-prompt-len", type=_length_range, default=(32, 96), help="MIN:MAX")
    parser.add_argument("--batch-output-len", type=_length_range, default=(64, 160), help="MIN:MAX")
    parser.add_argument("--backlog", type=int, default=24, help="batch requests kept in flight")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--plot", help="write the timeline PNG here")


def traffic_of(args: argparse.Namespace) -> Traffic:
    return Traffic(args.seed, args.duration, args.interactive_rate, args.interactive_prompt_len,
                   args.interactive_output_len, args.batch_prompt_len, args.batch_output_len, args.backlog)


def run_command(args: argparse.Namespace) -> int:
    overrides = {key: getattr(args, key, None) for key in (*MODEL_FLAG_KEYS, "swap_space_bytes")}
    traffic = traffic_of(args)
    settings, traces = run_all(overrides, traffic, getattr(args, "config", None), gc_as_served=True)
    report = build_report(settings, traffic, traces)
    print(render_table(report))
    write_report(args.out, report)
    if args.plot:
        plot_timeline(report, Path(args.plot))
    return 0
