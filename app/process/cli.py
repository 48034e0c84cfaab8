"""app's commands: serve, generate, tenants. The installed `fairlane` command is `benchmarks.cli.main`,
which adds `bench` through `extra_commands`: app never imports the benchmarks, they import app."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import Callable, Sequence

from app.batch.database import StoreError
from app.process.compile_command import add_compile_command
from app.process.flags import add_model_flags, settings_from_args
from app.process.server import add_serve_command
from app.process.tenants_cli import add_tenants_command
from config.settings import SettingsError
from tenancy.tenants import TenantsFileError

SubcommandRegistrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _add_generate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("generate", help="generate one answer from a prompt and print it")
    add_model_flags(parser)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--raw", action="store_true", help="complete the prompt as text (no chat template)")
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from app.process.engine_factory import build_engine
    from scheduling.request import Request, RequestId

    settings = settings_from_args(args)

    async def generate() -> None:
        engine, runner = build_engine(settings)
        tokenizer = runner.loaded.tokenizer
        prompt = tokenizer.encode(args.prompt) if args.raw else tokenizer.encode_chat(
            [{"role": "user", "content": args.prompt}])
        await engine.start()
        request = Request(RequestId(uuid.uuid4().hex), prompt, args.max_tokens,
                          stop_token_ids=tokenizer.eos_token_ids)
        tokens: list[int] = []
        async for event in engine.submit(request):
            tokens.extend(event.new_token_ids)
            if event.finish_reason is not None:
                break
        await engine.shutdown()
        print(tokenizer.decode(tokens))

    asyncio.run(generate())
    return 0


APP_COMMANDS: tuple[SubcommandRegistrar, ...] = (add_serve_command, add_compile_command, _add_generate,
                                                 add_tenants_command)


def build_parser(extra_commands: Sequence[SubcommandRegistrar] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairlane", description="A multi-tenant LLM serving server.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for register in (*APP_COMMANDS, *extra_commands):
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, extra_commands: Sequence[SubcommandRegistrar] = ()) -> int:
    """Parse argv and run the chosen command; a bad settings, tenants or store file exits 2, naming it."""
    args = build_parser(extra_commands).parse_args(argv)
    try:
        return int(args.handler(args))
    except (SettingsError, TenantsFileError, StoreError) as exc:
        print(f"fairlane: {exc}", file=sys.stderr)
        return 2
