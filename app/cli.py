"""The `fairlane` command: serve, generate, bench, tenants."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import Callable, Sequence

from app.batch.database import StoreError
from app.tenants_cli import add_tenants_command
from config.settings import Settings, SettingsError, load_settings
from tenancy.tenants import TenantsFileError

SubcommandRegistrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model spec: smollm2-135m, builtin:tiny, builtin:small, "
                                        "a checkpoint dir or a .gguf file")
    parser.add_argument("--config", help="a TOML settings file")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--quantization", choices=["none", "int8", "int4"],
                        help="weight-only quantization of every linear layer, the LM head included")
    parser.add_argument("--kv-cache-bytes", type=int, help="the KV pool in bytes (default: a share of free memory)")
    parser.add_argument("--kv-cache-memory-fraction", type=float,
                        help="the KV pool's share of the memory free after loading, without --kv-cache-bytes")
    parser.add_argument("--block-size", type=int)


MODEL_FLAG_KEYS = ("model", "device", "dtype", "quantization", "max_num_seqs", "max_num_batched_tokens",
                   "kv_cache_bytes", "kv_cache_memory_fraction", "block_size")


def settings_from_args(args: argparse.Namespace, extra_keys: Sequence[str] = ()) -> Settings:
    overrides = {key: getattr(args, key, None) for key in (*MODEL_FLAG_KEYS, *extra_keys)}
    return load_settings(getattr(args, "config", None), overrides=overrides)


def _add_generate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("generate", help="generate one answer from a prompt and print it")
    add_model_flags(parser)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--raw", action="store_true", help="complete the prompt as text (no chat template)")
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from app.engine_factory import build_engine
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


def _add_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from loadtest.bench import add_bench_commands

    parser = subparsers.add_parser("bench", help="benchmarks that compare systems side by side")
    add_bench_commands(parser.add_subparsers(dest="bench", required=True))


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    try:
        from app.server import add_serve_command
    except ImportError:  # the HTTP server is optional until it lands
        return
    add_serve_command(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairlane", description="A multi-tenant LLM serving server.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for register in (_add_serve, _add_generate, _add_bench, add_tenants_command):
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (SettingsError, TenantsFileError, StoreError) as exc:
        print(f"fairlane: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
