"""`python -m loadtest soak`, `overload`, `noisy-neighbour`, `latency` and `mixed`: the long runs, each with its
own flags.
Exit status: 0 when the run held, 1 when a check failed, 2 for a run refused before it began."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from loadtest.client import is_loopback_url
from loadtest.latency import PHASES, LatencyConfig, build_latency_report, run_latency, write_latency_report
from loadtest.mixed import MixedConfig, build_mixed_report, run_mixed, write_mixed_report
from loadtest.noisy import ABUSES, NoisyConfig, build_noisy_report, run_noisy, write_noisy_report
from loadtest.overload import OverloadConfig, run_overload
from loadtest.overload_report import build_overload_report, write_overload_report
from loadtest.soak import SoakConfig, run_soak
from loadtest.soak_report import build_soak_report, write_soak_report
from loadtest.workload import ANONYMOUS, LoadTenant, LoadTenantsError, load_admin_key, load_tenants

DEFAULT_URL = "http://127.0.0.1:8000"
MIB = 1024 * 1024
LONG_RUNS = ("soak", "overload", "noisy-neighbour", "latency", "mixed")
T = TypeVar("T")


def _common(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    p.add_argument("--tenants", help="the load tool's tenants file; its [admin] key reads /stats")
    p.add_argument("--out", default=f"data/loadtest/{name}", help="where the report and plots go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-remote", action="store_true", help="allow a URL that is not on this machine")


def soak_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest soak", description=__doc__)
    _common(p, "soak")
    p.add_argument("--minutes", type=float, required=True, help="the whole run, warm-up included")
    p.add_argument("--clients", type=int, default=8, help="closed-loop users")
    p.add_argument("--think", type=float, default=0.5, help="mean seconds between a user's requests")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of traffic before the baseline")
    p.add_argument("--sample", type=float, default=5.0, help="seconds between samples of the server")
    p.add_argument("--window", type=float, default=60.0, help="seconds per latency window")
    p.add_argument("--pid", type=int, help="the server's pid for /proc (default: the one /stats reports)")
    p.add_argument("--rss-margin-mib", type=float, default=64.0, help="idle RSS growth allowed after the load")
    return p


def overload_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest overload", description=__doc__)
    _common(p, "overload")
    p.add_argument("--capacity-clients", type=int, default=8, help="clients the server serves at once")
    p.add_argument("--factor", type=int, default=10, help="the surge brings this many times more clients")
    p.add_argument("--capacity-seconds", type=float, default=30.0)
    p.add_argument("--surge-seconds", type=float, default=120.0)
    p.add_argument("--batch-share", type=float, default=0.5, help="share of the surge's clients sending batch work")
    p.add_argument("--recovery-timeout", type=float, default=120.0)
    return p


def noisy_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest noisy-neighbour", description=__doc__)
    _common(p, "noisy-neighbour")
    p.add_argument("--phase-seconds", type=float, default=60.0, help="the light tenant's chats, per phase")
    p.add_argument("--light-clients", type=int, default=2, help="the light tenant's closed-loop chat users")
    p.add_argument("--light-batch-items", type=int, default=8)
    p.add_argument("--neighbour-batch-items", type=int, default=200)
    p.add_argument("--upload-mib", type=float, default=16.0, help="size of each of the neighbour's uploads")
    p.add_argument("--max-ratio", type=float, default=1.3, help="the light tenant's latency allowed, times alone")
    p.add_argument("--abuses", default="", help=f"the neighbour's abuses, comma-separated (default all: "
                                                f"{','.join(ABUSES)})")
    return p


def latency_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest latency", description=__doc__)
    _common(p, "latency")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--phase-seconds", type=float, default=60.0)
    p.add_argument("--interactive-streams", type=int, default=4)
    p.add_argument("--batch-streams", type=int, default=24)
    p.add_argument("--prompt-words", type=int, default=45, help="about 60 tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of each phase not measured")
    p.add_argument("--with", dest="earlier", action="append", default=[], metavar="REPORT",
                   help="an earlier run's report.json (another freshly started server): its phases join this report")
    p.add_argument("--peer", metavar="REPORT", help="another server's report.json: the flood's batch tokens/s "
                                                    "against its")
    return p


def mixed_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest mixed", description=__doc__)
    _common(p, "mixed")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--load", type=float, default=1.3, help="times the server's capacity")
    p.add_argument("--tokens-per-s", type=float, default=None,
                   help="the server's capacity, prompt and output tokens; default: --against's, else measured")
    p.add_argument("--label", default="", help="what the server ran with, for the report")
    p.add_argument("--scale", type=float, default=1.0, help="every length times this")
    p.add_argument("--against", help="an earlier run's report.json to compare with")
    return p


def tenants_of(path: str | None) -> tuple[tuple[LoadTenant, ...], str | None]:
    """The tenants file's tenants and admin key; one anonymous tenant and no key without a file."""
    return (load_tenants(path), load_admin_key(path)) if path else ((ANONYMOUS,), None)


def refuses_url(url: str, allow_remote: bool) -> bool:
    """True, saying why, for a URL not on this machine unless remote runs are allowed."""
    if is_loopback_url(url) or allow_remote:
        return False
    print(f"error: {url} is not a loopback address; pass --allow-remote to load another machine", file=sys.stderr)
    return True


def run_or_explain(url: str, run: Callable[[], T]) -> T | None:
    """run(), or None after saying why it was refused: a bad tenants file or flag, or a server it cannot use."""
    try:
        return run()
    except (LoadTenantsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
    except httpx.HTTPError as exc:
        print(f"error: cannot use the server at {url}: {exc!r}", file=sys.stderr)
    return None


def _soak(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    tenants, admin_key = tenants_of(args.tenants)
    config = SoakConfig(args.url.rstrip("/"), args.minutes, args.clients, args.think, args.warmup, args.sample,
                        args.window, args.seed, tenants, admin_key, args.pid,
                        rss_margin_bytes=int(args.rss_margin_mib * MIB))
    report = build_soak_report(asyncio.run(run_soak(config)))
    return report, write_soak_report(report, Path(args.out))


def _overload(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    tenants, _ = tenants_of(args.tenants)
    config = OverloadConfig(args.url.rstrip("/"), args.capacity_clients, args.factor, args.capacity_seconds,
                            args.surge_seconds, args.batch_share, recovery_timeout_s=args.recovery_timeout,
                            seed=args.seed, tenants=tenants)
    report = build_overload_report(asyncio.run(run_overload(config)))
    return report, write_overload_report(report, Path(args.out))


def _noisy(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    tenants, _ = tenants_of(args.tenants)
    config = NoisyConfig(args.url.rstrip("/"), tenants, args.phase_seconds, args.light_clients,
                         args.light_batch_items, args.neighbour_batch_items, upload_bytes=int(args.upload_mib * MIB),
                         max_ratio=args.max_ratio, seed=args.seed,
                         abuses=tuple(name for name in args.abuses.split(",") if name))
    report = build_noisy_report(asyncio.run(run_noisy(config)))
    return report, write_noisy_report(report, Path(args.out))


def _latency(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    tenants, _ = tenants_of(args.tenants)
    config = LatencyConfig(args.url.rstrip("/"), tenants[0], tuple(p for p in args.phases.split(",") if p),
                           args.phase_seconds, args.interactive_streams, args.batch_streams, args.prompt_words,
                           args.max_tokens, args.seed, args.warmup)
    load_before = os.getloadavg()[0]
    earlier = [json.loads(Path(path).read_text()) for path in args.earlier]
    peer = json.loads(Path(args.peer).read_text()) if args.peer else None
    phases = asyncio.run(run_latency(config))
    report = build_latency_report(config, phases, (load_before, os.getloadavg()[0]), earlier, peer)
    return report, write_latency_report(report, Path(args.out))


def _mixed(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    tenants, _ = tenants_of(args.tenants)
    against = json.loads(Path(args.against).read_text()) if args.against else None
    tokens_per_s = args.tokens_per_s if args.tokens_per_s is not None or against is None else \
        against["config"]["tokens_per_s"]
    config = MixedConfig(args.url.rstrip("/"), tenants, args.duration, args.load, tokens_per_s, args.seed,
                         args.label, args.scale)
    load_before = os.getloadavg()[0]
    result = asyncio.run(run_mixed(config))
    report = build_mixed_report(result, (load_before, os.getloadavg()[0]), against)
    report["passed"] = report["summary"]["errors"] == 0
    return report, write_mixed_report(report, Path(args.out))


RUNS = {"soak": (soak_parser, _soak), "overload": (overload_parser, _overload),
        "noisy-neighbour": (noisy_parser, _noisy), "latency": (latency_parser, _latency),
        "mixed": (mixed_parser, _mixed)}


def run_long(argv: list[str]) -> int:
    """argv starts with the run's name (one of LONG_RUNS)."""
    name, rest = argv[0], argv[1:]
    make_parser, run = RUNS[name]
    args = make_parser().parse_args(rest)
    if refuses_url(args.url, args.allow_remote):
        return 2
    done = run_or_explain(args.url, lambda: run(args))
    if done is None:
        return 2
    report, summary = done
    print(summary, end="")
    print(f"wrote {args.out}/report.json, summary.md and plots")
    return 0 if report["passed"] else 1
