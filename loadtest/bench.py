"""`fairlane bench ...`: each benchmark registers its subcommand here."""

from __future__ import annotations

import argparse


def add_bench_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Each benchmark module adds its own parser; a missing one is simply not offered yet."""
    import importlib

    for module_name in ("loadtest.bench_engine", "loadtest.bench_stream", "loadtest.bench_prefix",
                        "loadtest.bench_fairness", "loadtest.bench_preemption", "loadtest.bench_quality",
                        "loadtest.bench_serve"):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_command(subparsers)
