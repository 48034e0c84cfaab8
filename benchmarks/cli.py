"""The `fairlane` command as installed: app's commands (serve, generate, tenants) and `fairlane bench ...`.

The entry point lives here, in the top layer, because this is the one place that may import both app
and the benchmarks: app never imports benchmarks, so `app.process.cli.main` takes the bench command as one
more registrar instead of looking for it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from app.process.cli import SubcommandRegistrar
from app.process.cli import main as app_main
from benchmarks import (
    bench_cluster,
    bench_compile,
    bench_engine,
    bench_fairness,
    bench_kernels,
    bench_lora,
    bench_preemption,
    bench_prefix,
    bench_quality,
    bench_queue_order,
    bench_scheduler,
    bench_startup,
    bench_stream,
    make_checkpoint,
)
from cluster.cli import extend_serve_command
from loadtest import bench_serve

BENCH_COMMANDS: tuple[SubcommandRegistrar, ...] = (
    bench_engine.add_command, bench_stream.add_command, bench_prefix.add_command, bench_fairness.add_command,
    bench_preemption.add_command, bench_scheduler.add_command, bench_quality.add_command, bench_serve.add_command,
    bench_cluster.add_command, bench_lora.add_command, bench_compile.add_command,
    bench_startup.add_command, bench_kernels.add_command, bench_queue_order.add_command, make_checkpoint.add_command)


def add_bench_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks that compare systems side by side")
    bench_subparsers = parser.add_subparsers(dest="bench", required=True)
    for add_command in BENCH_COMMANDS:
        add_command(bench_subparsers)


def main(argv: Sequence[str] | None = None) -> int:
    return app_main(argv, extra_commands=(extend_serve_command, add_bench_command))


if __name__ == "__main__":
    sys.exit(main())
