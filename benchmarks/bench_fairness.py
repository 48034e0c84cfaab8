"""`fairlane bench fairness`: the same tenant arrivals replayed through the real scheduler under
weighted fair queues (VTC), first come first served (FCFS), and FCFS behind a per-tenant
requests-per-minute limit (RPM) that rejects what is over it.

No model runs. The executor is the scheduler tests' `FakeExecutor`, its step cost linear in the step's
tokens (`LinearStepCost`: a fixed overhead plus a cost per token) on a virtual clock, so a run takes
seconds and gives the same numbers on every machine. Arrivals are seeded Poisson processes: a heavy
tenant sending 10x what a light one sends, a second backlogged tenant of weight 2, and light tenants.
A last run, under VTC, leaves the heavy tenant out to show what it costs the light ones.

Service is `w_p` per prompt token computed plus `w_q` per generated token (the scheduler's VTC
weights), unweighted. Shares are of the service given while arrivals came (afterwards every system
just drains what is left, so the whole run's shares would be the same for all). A tenant counts as
backlogged when it had a request waiting at the start of at least 90% of the steps while arrivals
came; Jain's index is over their weight-normalized service in the steps where all of them waited.
TTFT runs from arrival to the end of the step that sampled the first token.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.fake_executors import FakeExecutor, LinearStepCost, sequence_service
from contract.plan import CacheGeometry
from loadtest.bench_output import format_table, write_report
from loadtest.stats import jain_index, percentile_or_nan
from scheduling.request import Request, RequestId
from scheduling.scheduler import Scheduler, SchedulerConfig
from tenancy.tenants import Tenant, TenantId, TenantRegistry

BACKLOGGED_FRACTION = 0.9  # of the arrival phase's steps with a request waiting
HEAVY = "heavy"


@dataclass(slots=True, frozen=True)
class TenantLoad:
    tenant_id: str
    weight: float
    rate: float  # requests per virtual second, Poisson
    is_light: bool = False  # counted in the light tenants' TTFT target


@dataclass(slots=True, frozen=True)
class FairnessWorkload:
    tenants: tuple[TenantLoad, ...]
    duration_s: float = 120.0  # arrivals come during this much virtual time; then the backlog drains
    seed: int = 0
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 256)


DEFAULT_TENANTS = (
    TenantLoad(HEAVY, 1.0, 10.0),
    TenantLoad("steady", 2.0, 12.0),
    TenantLoad("light-1", 1.0, 1.0, is_light=True),
    TenantLoad("light-2", 1.0, 1.0, is_light=True),
)


@dataclass(slots=True, frozen=True)
class Arrival:
    time: float
    tenant_id: str
    prompt_len: int
    output_len: int


def make_arrivals(workload: FairnessWorkload) -> list[Arrival]:
    """The same arrivals for every system: one seeded stream per tenant, so leaving a tenant out
    does not change the others' arrivals."""
    arrivals = []
    for tenant in workload.tenants:
        rng = random.Random(f"{workload.seed}:{tenant.tenant_id}")
        moment = rng.expovariate(tenant.rate)
        while moment < workload.duration_s:
            arrivals.append(Arrival(moment, tenant.tenant_id, rng.randint(*workload.prompt_len),
                                    rng.randint(*workload.output_len)))
            moment += rng.expovariate(tenant.rate)
    return sorted(arrivals, key=lambda a: (a.time, a.tenant_id))


class RpmLimiter:
    """At most `limit` accepted requests per tenant in any 60-second window; the rest are rejected."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._accepted: dict[str, deque[float]] = {}

    def allow(self, tenant_id: str, now: float) -> bool:
        window = self._accepted.setdefault(tenant_id, deque())
        while window and window[0] <= now - 60.0:
            window.popleft()
        if len(window) >= self.limit:
            return False
        window.append(now)
        return True


@dataclass(slots=True)
class SystemRun:
    """What one system did with the arrivals."""

    name: str
    weights: dict[str, float]
    service: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # whole run
    arrival_service: dict[str, float] = field(default_factory=dict)  # steps begun while arrivals came
    window_service: dict[str, float] = field(default_factory=dict)  # steps where all backlogged ones waited
    backlogged: list[str] = field(default_factory=list)
    ttft: dict[str, list[float]] = field(default_factory=dict)  # virtual seconds, per tenant
    rejected: Counter[str] = field(default_factory=Counter)
    timeline: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # cumulative service
    makespan_s: float = 0.0
    num_tokens: int = 0  # prompt and output tokens of the finished requests

    @property
    def jain(self) -> float | None:
        """None with fewer than two backlogged tenants: there is no contention to be fair about."""
        if len(self.backlogged) < 2:
            return None
        return jain_index([self.window_service[t] / self.weights[t] for t in self.backlogged])


@dataclass(slots=True)
class _Replay:
    """The loop of one system: admit arrivals that are due, step, record."""

    scheduler: Scheduler
    executor: FakeExecutor
    run: SystemRun
    duration_s: float
    limiter: RpmLimiter | None
    requests: dict[RequestId, Request] = field(default_factory=dict)
    waiting_steps: list[frozenset[str]] = field(default_factory=list)  # tenants waiting, per arrival-phase step
    step_service: list[dict[str, float]] = field(default_factory=list)

    def submit(self, arrival: Arrival, number: int) -> None:
        if self.limiter is not None and not self.limiter.allow(arrival.tenant_id, arrival.time):
            self.run.rejected[arrival.tenant_id] += 1
            return
        prompt = [(number * 31 + i) % 256 for i in range(arrival.prompt_len)]
        request = Request(RequestId(f"{arrival.tenant_id}-{number}"), prompt, arrival.output_len,
                          tenant_id=TenantId(arrival.tenant_id), arrival_time=arrival.time)
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def step(self) -> None:
        start = self.executor.clock
        waiting = frozenset(r.tenant_id for q in self.scheduler.waiting.values() for r in q)
        plan = self.scheduler.schedule()
        service: defaultdict[str, float] = defaultdict(float)
        weights = self.scheduler.config.service_weights
        for seq in plan.sequences:
            request = self.requests[RequestId(seq.request_id)]
            service[request.tenant_id] += sequence_service(seq, request.num_prompt_tokens, weights)
        result = self.executor.execute(plan)
        for event in self.scheduler.update(plan, result):
            request = self.requests[event.request_id]
            if event.num_output_tokens == 1 and event.new_token_ids:
                self.run.ttft.setdefault(request.tenant_id, []).append(self.executor.clock - request.arrival_time)
            if event.is_final:
                self.run.num_tokens += event.num_prompt_tokens + event.num_output_tokens
        for tenant, amount in service.items():
            self.run.service[tenant] += amount
        self.run.timeline.append((self.executor.clock, {t: float(self.run.service[t]) for t in self.run.weights}))
        if start < self.duration_s:
            self.waiting_steps.append(waiting)
            self.step_service.append(service)

    def finish(self) -> None:
        """Pick the backlogged tenants and sum their service over the steps where all were waiting."""
        self.run.makespan_s = self.executor.clock
        num_steps = len(self.waiting_steps)
        counts = Counter(t for waiting in self.waiting_steps for t in waiting)
        self.run.backlogged = sorted(t for t, n in counts.items() if n >= BACKLOGGED_FRACTION * num_steps)
        together = set(self.run.backlogged)
        self.run.arrival_service = {t: sum(s.get(t, 0.0) for s in self.step_service) for t in self.run.weights}
        self.run.window_service = dict.fromkeys(together, 0.0)
        for waiting, service in zip(self.waiting_steps, self.step_service, strict=True):
            if together <= waiting:
                for tenant in together:
                    self.run.window_service[tenant] += service.get(tenant, 0.0)


def replay(name: str, arrivals: Sequence[Arrival], tenants: Sequence[TenantLoad], config: SchedulerConfig,
           geometry: CacheGeometry, cost: LinearStepCost, duration_s: float, rpm_limit: int | None = None) -> SystemRun:
    """Run the arrivals through a fresh scheduler until every request has finished."""
    registry = TenantRegistry([Tenant(TenantId(t.tenant_id), t.weight) for t in tenants], requires_auth=False)
    executor = FakeExecutor(geometry, cost, vocab_size=256)
    run = SystemRun(name, {t.tenant_id: t.weight for t in tenants})
    loop = _Replay(Scheduler(config, geometry, registry), executor, run, duration_s,
                   RpmLimiter(rpm_limit) if rpm_limit is not None else None)
    due = 0
    while due < len(arrivals) or loop.scheduler.has_work():
        while due < len(arrivals) and arrivals[due].time <= executor.clock:
            loop.submit(arrivals[due], due)
            due += 1
        if loop.scheduler.has_work():
            loop.step()
        else:
            executor.clock = arrivals[due].time  # idle until the next arrival
    loop.finish()
    return run


# ---- the benchmark ---------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class FairnessBenchOptions:
    workload: FairnessWorkload = FairnessWorkload(DEFAULT_TENANTS)
    cost: LinearStepCost = field(default_factory=LinearStepCost)
    rpm_limit: int = 360  # requests per minute per tenant, for the RPM system
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    num_device_blocks: int = 1024
    block_size: int = 16


def run_systems(options: FairnessBenchOptions) -> dict[str, SystemRun]:
    """VTC, FCFS and RPM on the same arrivals, then VTC without the heavy tenant."""
    workload = options.workload
    geometry = CacheGeometry(options.num_device_blocks, 0, options.block_size, 0,
                             workload.prompt_len[1] + workload.output_len[1])
    vtc = SchedulerConfig(max_num_seqs=options.max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
                          queue_policy="vtc")
    fcfs = replace(vtc, queue_policy="fcfs", kv_share_limit=False)  # plain first come, first served
    arrivals = make_arrivals(workload)
    without_heavy = tuple(t for t in workload.tenants if t.tenant_id != HEAVY)
    args = (geometry, options.cost, workload.duration_s)
    return {
        "vtc": replay("vtc", arrivals, workload.tenants, vtc, *args),
        "fcfs": replay("fcfs", arrivals, workload.tenants, fcfs, *args),
        "rpm": replay("rpm", arrivals, workload.tenants, fcfs, *args, rpm_limit=options.rpm_limit),
        "vtc_without_heavy": replay("vtc_without_heavy", make_arrivals(replace(workload, tenants=without_heavy)),
                                    without_heavy, vtc, *args),
    }


def summarize(run: SystemRun) -> dict[str, Any]:
    total = sum(run.arrival_service.values()) or 1.0
    tenants = {
        t: {"weight": w, "share_of_service": run.arrival_service[t] / total, "requests_rejected": run.rejected[t],
            "requests_served": len(run.ttft.get(t, [])), "ttft_p50_s": percentile_or_nan(run.ttft.get(t, []), 50),
            "ttft_p99_s": percentile_or_nan(run.ttft.get(t, []), 99)}
        for t, w in run.weights.items()}
    return {"tenants": tenants, "backlogged": run.backlogged, "jain_index": run.jain,
            "throughput_tokens_per_s": run.num_tokens / run.makespan_s if run.makespan_s else 0.0,
            "makespan_s": run.makespan_s, "requests_rejected": sum(run.rejected.values())}


def build_report(options: FairnessBenchOptions, runs: dict[str, SystemRun]) -> dict[str, Any]:
    systems = {name: summarize(run) for name, run in runs.items()}
    lights = [t.tenant_id for t in options.workload.tenants if t.is_light]
    vtc, alone = systems["vtc"]["tenants"], systems["vtc_without_heavy"]["tenants"]
    ttft_ratio = max(vtc[t]["ttft_p99_s"] / alone[t]["ttft_p99_s"] for t in lights)
    throughput_ratio = systems["vtc"]["throughput_tokens_per_s"] / systems["fcfs"]["throughput_tokens_per_s"]
    vtc_jain = systems["vtc"]["jain_index"]
    targets = {
        "vtc_jain_index_at_least_0.99": vtc_jain is not None and vtc_jain >= 0.99,
        "light_ttft_p99_within_2x_of_without_heavy": ttft_ratio <= 2.0,
        "vtc_throughput_within_5pct_of_fcfs": throughput_ratio >= 0.95,
    }
    return {
        "benchmark": "fairness",
        "workload": {"duration_s": options.workload.duration_s, "seed": options.workload.seed,
                     "prompt_len": list(options.workload.prompt_len),
                     "output_len": list(options.workload.output_len),
                     "tenants": [{"id": t.tenant_id, "weight": t.weight, "rate_per_s": t.rate, "light": t.is_light}
                                 for t in options.workload.tenants]},
        "step_cost": {"overhead_s": options.cost.overhead_s, "per_token_s": options.cost.per_token_s},
        "scheduler": {"max_num_seqs": options.max_num_seqs, "max_num_batched_tokens": options.max_num_batched_tokens,
                      "num_device_blocks": options.num_device_blocks, "block_size": options.block_size},
        "rpm_limit": options.rpm_limit,
        "systems": systems,
        "light_ttft_p99_ratio": ttft_ratio,
        "throughput_ratio_vtc_to_fcfs": throughput_ratio,
        "targets": targets,
    }


def render_table(report: dict[str, Any]) -> str:
    """One row per system and tenant, then each system's totals, then the targets."""
    rows = [["system", "tenant", "weight", "share", "ttft p50 s", "ttft p99 s", "rejected"]]
    for name, system in report["systems"].items():
        for tenant, t in system["tenants"].items():
            rows.append([name, tenant, f"{t['weight']:g}", f"{t['share_of_service']:.1%}", f"{t['ttft_p50_s']:.3f}",
                         f"{t['ttft_p99_s']:.3f}", str(t["requests_rejected"])])
    totals = [["system", "jain (backlogged)", "backlogged", "tokens/s", "makespan s", "rejected"]]
    for name, system in report["systems"].items():
        jain = system["jain_index"]
        totals.append([name, "-" if jain is None else f"{jain:.4f}", ",".join(system["backlogged"]) or "-",
                       f"{system['throughput_tokens_per_s']:.0f}", f"{system['makespan_s']:.1f}",
                       str(system["requests_rejected"])])
    targets = [f"{'met' if met else 'MISSED'}: {name}" for name, met in report["targets"].items()]
    ratios = (f"light TTFT p99, with heavy / without: {report['light_ttft_p99_ratio']:.2f}x; "
              f"throughput VTC / FCFS: {report['throughput_ratio_vtc_to_fcfs']:.3f}")
    return "\n\n".join([format_table(rows), format_table(totals), ratios, "\n".join(targets)])


def plot_cumulative_service(runs: dict[str, SystemRun], path: Path, arrivals_end_s: float) -> None:
    """One panel per system: each tenant's cumulative service against virtual time, a tenant in the
    same colour in every panel; the dashed line is where arrivals stop."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenants = list(dict.fromkeys(t for run in runs.values() for t in run.weights))
    figure, axes = plt.subplots(len(runs), 1, figsize=(8, 3 * len(runs)), sharex=True, squeeze=False)
    for axis, (name, run) in zip(axes[:, 0], runs.items(), strict=True):
        times = [moment for moment, _ in run.timeline]
        for tenant in run.weights:
            axis.plot(times, [cumulative[tenant] for _, cumulative in run.timeline],
                      label=f"{tenant} (w={run.weights[tenant]:g})", color=f"C{tenants.index(tenant)}")
        axis.axvline(arrivals_end_s, color="grey", linestyle="--", linewidth=0.8)
        axis.set_title(name)
        axis.set_ylabel("cumulative service")
        axis.legend(loc="upper left", fontsize="small")
    axes[-1, 0].set_xlabel("virtual seconds")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("fairness", help="per-tenant service, Jain's index and TTFT under VTC, FCFS and "
                                                    "an RPM limit, on one seeded multi-tenant arrival trace")
    parser.add_argument("--duration", type=float, default=120.0, help="virtual seconds of arrivals")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and request lengths")
    parser.add_argument("--rpm-limit", type=int, default=360, help="requests per minute per tenant, RPM system")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--plot", help="write the cumulative-service PNG here")
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    options = FairnessBenchOptions(FairnessWorkload(DEFAULT_TENANTS, args.duration, args.seed),
                                   rpm_limit=args.rpm_limit)
    runs = run_systems(options)
    report = build_report(options, runs)
    print(render_table(report))
    write_report(args.out, report)
    if args.plot:
        plot_cumulative_service(runs, Path(args.plot), options.workload.duration_s)
    return 0
