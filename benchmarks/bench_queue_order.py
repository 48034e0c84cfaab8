"""`fairlane bench queue-order`: the order inside each tenant's line, FCFS against HRRN, SRPT and LPM, on
one seeded mixed-length trace past capacity, by the real scheduler on the simulated executor.

Two tenants of equal weight send interactive chats at Poisson times: prompt and output lengths lognormal
(a median of about 300 and 100 tokens), and one request in twenty a 4,000-token document to summarize.
Arrivals run for --duration virtual seconds at about 1.3x what the executor serves, then the backlog
drains. The executor's step costs a fixed 20 ms plus 1.8 ms per token fed, the default model's line on an
AVX2 EPYC (`/stats` step_cost). Reported per order: mean and p99 TTFT, the p99 TTFT of the longest
prompt bucket (the documents), the output-length predictor's rank correlation, and Jain's index of the two
tenants' service while both were backlogged; and each against FCFS. Service and backlog are VTC's own, as in
the fairness tests: w_p per prompt token computed and w_q per token generated, while each tenant has a
request unfinished (waiting or running). Counted while both had one *waiting* instead, the index moves with
the order even where VTC's counters stay level: a tenant whose line empties while its requests still run
keeps being charged, and catches up in the steps the narrower window counts.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

from benchmarks.fake_executors import FakeExecutor, LinearStepCost, sequence_service
from contract.plan import CacheGeometry, StepPlan
from loadtest.mixed import LONG_BUCKET, TraceRequest, poisson_trace
from scheduling.queue_order import QUEUE_ORDERS, QueueOrderName
from scheduling.request import PriorityClass, Request, RequestId
from scheduling.scheduler import Scheduler, SchedulerConfig
from scheduling.step_shaper import ShapingConfig
from tenancy.tenants import Tenant, TenantId, TenantRegistry

COST = LinearStepCost(overhead_s=0.020, per_token_s=0.0018)
TENANTS = ("a", "b")


def make_trace(duration_s: float, seed: int, load: float) -> list[TraceRequest]:
    """The trace `python -m loadtest mixed` sends a real server, at the simulated executor's cost."""
    return poisson_trace(duration_s, seed, load, COST.per_token_s, len(TENANTS))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_order(order: QueueOrderName, trace: list[TraceRequest], seed: int, aging_s: float,
              fcfs_stretch: float = 0.0, max_num_seqs: int = 32) -> dict[str, Any]:
    clock = Clock()
    tenants = TenantRegistry([Tenant(TenantId(t)) for t in TENANTS], requires_auth=False)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, queue_order=order,
                             queue_aging_s=aging_s, queue_fcfs_stretch=fcfs_stretch,
                             shaping=ShapingConfig(enabled=False))
    geometry = CacheGeometry(num_device_blocks=4096, num_cpu_blocks=0, block_size=16, bytes_per_block=1,
                             max_model_len=8192)
    scheduler = Scheduler(config, geometry, tenants, clock=clock)
    executor = FakeExecutor(geometry, COST, keep_plans=False)
    requests: list[Request] = []
    pending = list(trace)
    served: dict[str, float] = dict.fromkeys(TENANTS, 0.0)
    while pending or scheduler.has_work():
        while pending and pending[0].arrival_s <= clock.now:
            item = pending.pop(0)
            request = _request(item, len(requests), seed)
            scheduler.add_request(request)
            requests.append(request)
        if not scheduler.has_work():
            clock.now = pending[0].arrival_s
            continue
        plan = scheduler.schedule()
        backlogged = set(TENANTS) <= scheduler.load.backlogged(PriorityClass.INTERACTIVE)
        if backlogged:
            _add_service(served, plan, scheduler)
        starting = [scheduler.requests[RequestId(s.request_id)] for s in plan.sequences if s.needs_sample]
        starting = [r for r in starting if r.first_token_time is None]
        result = executor.execute(plan)
        clock.now += COST.seconds(plan) or 0.001
        scheduler.update(plan, result)
        for request in starting:  # stamped as the engine stamps them
            request.first_token_time = clock.now
    return _summary(order, requests, served, scheduler)


def _add_service(served: dict[str, float], plan: StepPlan, scheduler: Scheduler) -> None:
    """Each tenant's service in the step, as VTC counts it and the fairness tests measure it: w_p per
    prompt token computed, w_q per token generated."""
    weights = scheduler.config.service_weights
    for seq in plan.sequences:
        request = scheduler.requests[RequestId(seq.request_id)]
        served[request.tenant_id] += sequence_service(seq, request.num_prompt_tokens, weights)


def _request(item: TraceRequest, number: int, seed: int) -> Request:
    rng = random.Random(f"{seed}-{number}")
    prompt = [rng.randrange(256) for _ in range(item.prompt_tokens)]
    tenant = TENANTS[item.tenant]
    return Request(RequestId(f"{tenant}-{number}"), prompt, item.output_tokens, tenant_id=TenantId(tenant),
                   arrival_time=item.arrival_s)


def _summary(order: str, requests: list[Request], served: dict[str, float], scheduler: Scheduler) -> dict[str, Any]:
    ttfts = sorted(r.first_token_time - r.arrival_time for r in requests if r.first_token_time is not None)
    longest = sorted(r.first_token_time - r.arrival_time for r in requests
                     if r.first_token_time is not None and r.num_prompt_tokens >= LONG_BUCKET)
    total = sum(served.values())
    jain = total ** 2 / (len(served) * sum(v * v for v in served.values())) if total else None
    return {"order": order, "requests": len(requests), "ttft_mean_s": sum(ttfts) / len(ttfts),
            "ttft_p99_s": _p99(ttfts), "longest_bucket_ttft_p99_s": _p99(longest),
            "jain": jain, "output_length_rank_correlation": scheduler.output_lengths.measured_rank_correlation()}


def _p99(values: list[float]) -> float | None:
    return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)] if values else None


def render(report: dict[str, Any]) -> str:
    base = report["orders"]["fcfs"]
    lines = [f"{'order':<6} {'mean TTFT s':>11} {'x FCFS':>7} {'p99 TTFT s':>10} {'longest p99 s':>13} "
             f"{'x FCFS':>7} {'Jain':>6} {'rank rho':>8}"]
    for name, row in report["orders"].items():
        rho = row["output_length_rank_correlation"]
        lines.append(f"{name:<6} {row['ttft_mean_s']:>11.2f} {row['ttft_mean_s'] / base['ttft_mean_s']:>7.2f} "
                     f"{row['ttft_p99_s']:>10.2f} {row['longest_bucket_ttft_p99_s']:>13.2f} "
                     f"{row['longest_bucket_ttft_p99_s'] / base['longest_bucket_ttft_p99_s']:>7.2f} "
                     f"{row['jain']:>6.3f} {'-' if rho is None else f'{rho:.2f}':>8}")
    return "\n".join(lines)


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("queue-order", help="FCFS, HRRN, SRPT and LPM inside each tenant's line, on a "
                                                       "mixed-length trace past capacity (simulated executor)")
    parser.add_argument("--duration", type=float, default=300.0, help="virtual seconds of arrivals")
    parser.add_argument("--load", type=float, default=1.3, help="offered work over what the executor serves")
    parser.add_argument("--seed", type=int, default=0)
    defaults = SchedulerConfig()  # the server's
    parser.add_argument("--aging", type=float, default=defaults.queue_aging_s,
                        help="the aging bound, seconds (hrrn, srpt, lpm)")
    parser.add_argument("--fcfs-stretch", type=float, default=defaults.queue_fcfs_stretch,
                        help="the bound against FCFS (scheduling/fcfs_bound.py; hrrn, srpt, lpm); 0: off")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                        help="the scheduler's running sequences")
    parser.add_argument("--out", help="write the JSON report here")
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    trace = make_trace(args.duration, args.seed, args.load)
    report = {"duration_s": args.duration, "load": args.load, "seed": args.seed, "aging_s": args.aging,
              "fcfs_stretch": args.fcfs_stretch, "max_num_seqs": args.max_num_seqs,
              "orders": {order: run_order(order, trace, args.seed, args.aging, args.fcfs_stretch, args.max_num_seqs)
                         for order in QUEUE_ORDERS}}
    print(render(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0
