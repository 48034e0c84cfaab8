"""`fairlane compile`: compile the forward of the settings' model into the artifact folder, then exit.

Run by hand (or in an image build, or CI) it warms the cache ahead of time, so that a server's
compiled forward is ready seconds after it starts. `fairlane serve` runs it as a child process with
its own settings (`--settings-json`) and serves eagerly until it is done (gpu/background_compile.py);
the child then prints its progress as JSON lines and exits when the server does.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from app.process.flags import add_model_flags, settings_from_args
from config.settings import Settings


def add_compile_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("compile", help="compile the forward ahead of time into the artifact cache")
    add_model_flags(parser)
    add_child_flags(parser)
    parser.set_defaults(handler=run_compile)


def add_child_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, help="torch threads the kernels are generated for "
                                                    "(default: torch's own count, as `fairlane serve` uses)")
    # What `fairlane serve` passes to its compiling child; not for people.
    parser.add_argument("--settings-json", help=argparse.SUPPRESS)
    parser.add_argument("--progress-json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)


def run_compile(args: argparse.Namespace) -> int:
    import torch

    from app.process.engine_factory import compile_config_of, kv_cache_dtype_of, load_model_for, lora_serving_of
    from gpu.background_compile import exit_with_parent, progress_line
    from gpu.runner import SCRATCH_POOL_BLOCKS, ModelRunner, RunnerBudget, kv_shape_of

    settings = Settings.model_validate_json(args.settings_json) if args.settings_json else settings_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [compile]: %(message)s")
    if settings.compile_mode == "eager":
        print("fairlane compile: --compile eager has nothing to compile", file=sys.stderr)
        return 2
    if args.exit_with_parent:
        exit_with_parent()
    if args.threads:
        torch.set_num_threads(args.threads)

    def report(step: int, num_steps: int, label: str) -> None:
        if args.progress_json:
            print(progress_line(step=step, num_steps=num_steps, label=label), flush=True)

    loaded = load_model_for(settings)
    # A pool of a few blocks: the graph takes any pool size (gpu/compiled.py), so the server's pool,
    # sized from its free memory, finds these artifacts all the same.
    kv_dtype = kv_cache_dtype_of(settings, loaded)  # the pool's dtype shapes the graph: the server's
    block_bytes = kv_shape_of(loaded, settings.block_size, kv_dtype).bytes_per_block
    budget = RunnerBudget(block_size=settings.block_size, kv_cache_bytes=SCRATCH_POOL_BLOCKS * block_bytes,
                          swap_space_bytes=0, max_model_len=settings.max_model_len, seed=settings.seed,
                          kv_cache_dtype=kv_dtype)
    runner = ModelRunner(loaded, budget, compile_config_of(settings, on_warm_up_step=report), lora_serving_of(settings))
    forward = runner.forward
    if args.progress_json:
        print(progress_line(done=True, graphs=forward.num_graphs, seconds=round(forward.compile_seconds, 1)),
              flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fairlane compile")
    add_model_flags(parser)
    add_child_flags(parser)
    return run_compile(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
