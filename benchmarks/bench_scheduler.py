"""`fairlane bench scheduler`: what the scheduler itself costs per step, at the scale of a busy server.

No model runs: `FakeExecutor` answers each plan with a sampled token for every sequence that needs
one, and only the scheduler's own work is timed. The workload keeps about `--running` requests
running (the sequence cap, and KV blocks for that many requests at their longest) and `--waiting`
more queued behind them, from `--tenants` tenants of weights 1, 2 and 3: after every step, new
requests replace the ones that finished. The steps of a warm-up, while the running set fills,
are not timed.

Each timed step is `schedule()` plus `update()`, measured with `time.perf_counter`; the executor's
own time and the top-up between steps stay out of the clock (the top-up hashes each new prompt's
blocks, as `Engine.submit` does). On a GPU a decode step of a small model takes about 10 ms, so the
target is a p99 under 1 ms. The engine also takes the scheduler's snapshot and feeds the step cost
model after every step: that bookkeeping is timed apart, as its own row. A last row is the floor of
this design at the same scale (see `time_floor`).

As `fairlane serve` does after start-up, the process freezes its objects out of the garbage collector
once the scheduler is built (before any request exists), and installs the engine's paced collection:
the driver asks for the collections due between `schedule()` and `update()`, where the engine asks
while the runner computes, and times them as their own row.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.fake_executors import FakeExecutor
from contract.plan import CacheGeometry, ScheduledSequence
from loadtest.bench_output import format_table, write_report
from loadtest.stats import percentile_or_nan
from scheduling.gc_pacing import PacedCollector, paced_collection
from scheduling.prefix_cache import prompt_block_hashes
from scheduling.request import PriorityClass, Request, RequestId, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import Tenant, TenantId, TenantRegistry

P99_TARGET_MS = 1.0
VOCAB = 256  # byte tokens


@dataclass(slots=True, frozen=True)
class SchedulerWorkload:
    num_running: int = 256  # the sequence cap, and KV blocks for this many requests at their longest
    num_waiting: int = 1000  # kept queued behind the running ones
    num_tenants: int = 100
    batch_share: float = 0.0  # of the requests, the share sent in the batch class (0: interactive only)
    prompt_len: tuple[int, int] = (32, 256)  # inclusive, uniform
    output_len: tuple[int, int] = (16, 128)  # inclusive, uniform; generated exactly (no stop token)
    seed: int = 0


@dataclass(slots=True, frozen=True)
class SchedulerBenchOptions:
    workload: SchedulerWorkload = field(default_factory=SchedulerWorkload)
    num_steps: int = 300  # timed
    num_warmup_steps: int = 50  # untimed: the running set fills in the first few dozen steps
    max_num_batched_tokens: int = 2048  # a decode for every running request, and prefill chunks
    block_size: int = 16

    def geometry(self) -> CacheGeometry:
        """Device blocks for num_running requests at their longest; as many CPU blocks for swapping."""
        max_len = self.workload.prompt_len[1] + self.workload.output_len[1]
        num_blocks = self.workload.num_running * -(-max_len // self.block_size)
        return CacheGeometry(num_blocks, num_blocks, self.block_size, 0, max_len)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.workload.num_running,
                               max_num_batched_tokens=self.max_num_batched_tokens)


@dataclass(slots=True, frozen=True)
class StepTiming:
    schedule_s: float
    update_s: float
    bookkeeping_s: float  # what the engine does after each step: the cost model's observation, the snapshot
    collection_s: float  # the garbage collection the engine makes while the runner computes (gc_pacing.py)
    num_running: int  # sequences in the step's plan
    num_waiting: int  # unfinished requests not in the plan (queued, or swapped out)


class RequestSource:
    """Seeded requests, one tenant drawn uniformly for each; the same stream on every run."""

    def __init__(self, workload: SchedulerWorkload) -> None:
        self._workload = workload
        self._rng = random.Random(workload.seed)
        self._num_made = 0

    def next_request(self) -> Request:
        w, rng = self._workload, self._rng
        number = self._num_made
        self._num_made += 1
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(*w.prompt_len))]
        priority = PriorityClass.BATCH if rng.random() < w.batch_share else PriorityClass.INTERACTIVE
        return Request(RequestId(f"r{number}"), prompt, rng.randint(*w.output_len),
                       tenant_id=tenant_id(rng.randrange(w.num_tenants)), priority=priority,
                       arrival_time=float(number))  # arrival order decides preemption victims: keep it seeded


def tenant_id(index: int) -> TenantId:
    return TenantId(f"tenant-{index:03d}")


def make_tenants(num_tenants: int) -> TenantRegistry:
    return TenantRegistry([Tenant(tenant_id(i), float(1 + i % 3)) for i in range(num_tenants)], requires_auth=False)


class SchedulerDriver:
    """The engine's loop without the engine: top up, schedule, execute, update."""

    def __init__(self, options: SchedulerBenchOptions) -> None:
        geometry = options.geometry()
        workload = options.workload
        self.scheduler = Scheduler(options.scheduler_config(), geometry, make_tenants(workload.num_tenants))
        self.executor = FakeExecutor(geometry, vocab_size=VOCAB, keep_plans=False)
        self.collector = PacedCollector()
        self.source = RequestSource(workload)
        self.num_unfinished_target = workload.num_running + workload.num_waiting
        self.block_size = geometry.block_size
        self.num_unfinished = 0

    def top_up(self) -> None:
        """Replace the requests that finished, so that as many as before run and wait."""
        while self.num_unfinished < self.num_unfinished_target:
            request = self.source.next_request()
            # As Engine.submit does, on the caller's side of the queue: not a step's work.
            request.prompt_block_hashes = prompt_block_hashes(request.prompt_token_ids, self.block_size,
                                                              request.cache_salt)
            self.scheduler.add_request(request)
            self.num_unfinished += 1

    def step(self) -> StepTiming:
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        scheduled = time.perf_counter()
        result = self.executor.execute(plan)
        collecting = time.perf_counter()
        self.collector.collect_due()  # as the engine does while the runner computes the step
        updating = time.perf_counter()
        events = self.scheduler.update(plan, result)
        updated = time.perf_counter()
        self.scheduler.observe_step_time(plan, result.forward_seconds)
        self.scheduler.snapshot()
        kept = time.perf_counter()
        num_in_plan = len(plan.sequences)
        timing = StepTiming(scheduled - started, updated - updating, kept - updated, updating - collecting,
                            num_in_plan, self.num_unfinished - num_in_plan)
        self.num_unfinished -= sum(event.is_final for event in events)
        return timing


def run_steps(options: SchedulerBenchOptions) -> list[StepTiming]:
    """Warm up, then the timed steps; the workload is topped up before each."""
    driver = SchedulerDriver(options)
    with paced_collection():
        timings = []
        for number in range(options.num_warmup_steps + options.num_steps):
            driver.top_up()
            timing = driver.step()
            if number >= options.num_warmup_steps:
                timings.append(timing)
        return timings


def time_floor(options: SchedulerBenchOptions) -> list[float]:
    """Per step, the floor of a scheduler that hands the runner one sequence per request and the engine one
    event per request, as this one does: for `num_running` requests decoding, only making a step's
    `ScheduledSequence`s and `TokenEvent`s and appending each sampled token, with no decision at all. What
    schedule + update take above it is the scheduler's own work."""
    source = RequestSource(options.workload)
    requests = [source.next_request() for _ in range(options.workload.num_running)]
    new_event = tuple.__new__  # as Scheduler.update makes its events
    collector = PacedCollector()
    with paced_collection():
        timings = []
        for _ in range(options.num_steps):
            collector.collect_due()
            started = time.perf_counter()
            sequences = [ScheduledSequence(r.request_id, r.token_ids[-1:], r.num_computed_tokens, (), True, r.sampling)
                         for r in requests]
            events = []
            for request in requests:
                request.token_ids.append(0)
                request.num_computed_tokens += 1
                events.append(new_event(TokenEvent, (request.request_id, (0,), None, request.num_prompt_tokens,
                                                     request.num_output_tokens, 0, None, (), ())))
            timings.append(time.perf_counter() - started)
            del sequences, events
        return timings


# ---- the report ------------------------------------------------------------------------------------


def milliseconds(seconds: list[float]) -> dict[str, float]:
    in_ms = [s * 1000 for s in seconds]
    return {"p50": percentile_or_nan(in_ms, 50), "p99": percentile_or_nan(in_ms, 99), "max": max(in_ms, default=0.0)}


def build_report(options: SchedulerBenchOptions, timings: list[StepTiming], floor_s: list[float]) -> dict[str, Any]:
    geometry = options.geometry()
    config = options.scheduler_config()
    num_steps = len(timings) or 1
    per_step = {
        "schedule_and_update": milliseconds([t.schedule_s + t.update_s for t in timings]),
        "schedule": milliseconds([t.schedule_s for t in timings]),
        "update": milliseconds([t.update_s for t in timings]),
        "snapshot_and_cost_model": milliseconds([t.bookkeeping_s for t in timings]),
        "paced_gc_while_runner_computes": milliseconds([t.collection_s for t in timings]),
        "per_request_objects_floor": milliseconds(floor_s),  # see time_floor
    }
    return {
        "benchmark": "scheduler",
        "workload": {**asdict(options.workload), "prompt_len": list(options.workload.prompt_len),
                     "output_len": list(options.workload.output_len)},
        "scheduler": {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                      "queue_policy": config.queue_policy, "num_device_blocks": geometry.num_device_blocks,
                      "num_cpu_blocks": geometry.num_cpu_blocks, "block_size": geometry.block_size},
        "warmup_steps": options.num_warmup_steps,
        "steps": len(timings),
        "running_mean": sum(t.num_running for t in timings) / num_steps,
        "waiting_mean": sum(t.num_waiting for t in timings) / num_steps,
        "per_step_ms": per_step,
        "targets": {"p99_under_1ms": per_step["schedule_and_update"]["p99"] < P99_TARGET_MS},
    }


def render_table(report: dict[str, Any]) -> str:
    rows = [["per step", "p50 ms", "p99 ms", "max ms", "steps", "running", "waiting"]]
    for name, ms in report["per_step_ms"].items():
        label = name.replace("_and_", " + ").replace("_", " ")
        rows.append([label, f"{ms['p50']:.3f}", f"{ms['p99']:.3f}", f"{ms['max']:.3f}",
                     str(report["steps"]), f"{report['running_mean']:.0f}", f"{report['waiting_mean']:.0f}"])
    met = report["targets"]["p99_under_1ms"]
    return f"{format_table(rows)}\n\n{'met' if met else 'MISSED'}: schedule + update p99 under {P99_TARGET_MS:g} ms"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("scheduler", help="the scheduler's own time per step (schedule + update) with "
                                                     "hundreds running and a thousand waiting, no model")
    options, defaults = SchedulerBenchOptions(), SchedulerWorkload()
    parser.add_argument("--steps", type=positive_int, default=options.num_steps, help="timed steps")
    parser.add_argument("--warmup-steps", type=int, default=options.num_warmup_steps,
                        help="untimed steps first, while the running set fills")
    parser.add_argument("--running", type=positive_int, default=defaults.num_running, help="requests running at once")
    parser.add_argument("--waiting", type=int, default=defaults.num_waiting, help="requests kept waiting")
    parser.add_argument("--tenants", type=positive_int, default=defaults.num_tenants,
                        help="tenants the requests come from")
    parser.add_argument("--batch-share", type=float, default=defaults.batch_share,
                        help="share of the requests in the batch class (0 to 1)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the request lengths and tenants")
    parser.add_argument("--out", help="write the JSON report here")
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    workload = SchedulerWorkload(num_running=args.running, num_waiting=args.waiting, num_tenants=args.tenants,
                                 batch_share=args.batch_share, seed=args.seed)
    options = SchedulerBenchOptions(workload, num_steps=args.steps, num_warmup_steps=args.warmup_steps)
    report = build_report(options, run_steps(options), time_floor(options))
    print(render_table(report))
    write_report(args.out, report)
    return 0
