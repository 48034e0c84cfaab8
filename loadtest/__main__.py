"""`python -m loadtest SCENARIO --url URL ...`: run one load-test scenario against a fairlane server and
write report.json, summary.md and PNG plots into --out. `python -m loadtest
soak|overload|noisy-neighbour|latency --help`: the long runs (loadtest.commands). Exits 1 when the leak
check fails (KV blocks still in use, or requests still running, once the server should be idle), 2 for a
run it refuses."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from loadtest.commands import LONG_RUNS, refuses_url, run_long, run_or_explain, tenants_of
from loadtest.plots import write_plots
from loadtest.report import build_report, write_report
from loadtest.scenarios import MAX_DURATION_S, MAX_REQUESTS, SCENARIOS, RunConfig, RunResult, run_scenario

DEFAULT_URL = "http://127.0.0.1:8000"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    p.add_argument("scenario", choices=list(SCENARIOS))
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    p.add_argument("--duration", type=float, default=20.0, help=f"seconds of sending (at most {MAX_DURATION_S:g})")
    p.add_argument("--rate", type=float, default=2.0, help="interactive requests/s, all tenants together")
    p.add_argument("--tenants", help="the load tool's tenants file ([[tenants]] id, api_key, weight); "
                                     "without it one tenant and no API key")
    p.add_argument("--out", help="where the report and plots go (default data/loadtest/SCENARIO)")
    p.add_argument("--max-requests", type=int, default=500, help=f"requests sent at most (at most {MAX_REQUESTS})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backlog", type=int, default=8, help="flood: batch-class requests kept in flight")
    p.add_argument("--batch-items", type=int, default=16, help="batch-api: items in all, one batch per tenant")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds a response may stall")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds running requests get once sending stops; the rest are cancelled")
    p.add_argument("--settle-timeout", type=float, default=30.0,
                   help="seconds the server gets to come back to idle before the leak check fails")
    p.add_argument("--allow-remote", action="store_true", help="allow a URL that is not on this machine")
    return p


def _run(args: argparse.Namespace) -> RunResult:
    tenants, admin_key = tenants_of(args.tenants)
    config = RunConfig(args.scenario, args.url.rstrip("/"), args.duration, args.rate, args.max_requests, args.seed,
                       tenants, args.backlog, args.batch_items, args.request_timeout, args.drain_timeout,
                       args.settle_timeout, admin_key)
    config.check()
    return asyncio.run(run_scenario(config))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in LONG_RUNS:
        return run_long(argv)
    args = parser().parse_args(argv)
    if refuses_url(args.url, args.allow_remote):
        return 2
    result = run_or_explain(args.url, lambda: _run(args))
    if result is None:
        return 2
    out_dir = Path(args.out or f"data/loadtest/{args.scenario}")
    report = build_report(result)
    plots = write_plots(result.records, report, out_dir)
    print(write_report(report, out_dir, plots), end="")
    print(f"wrote {out_dir}/report.json, summary.md, {', '.join(Path(p).name for p in plots)}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
