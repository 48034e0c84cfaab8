"""`fairlane bench quality`: what each quantization mode costs in answers, against float32.

A mode is a quantization, optionally with the KV cache's dtype after a colon (`int4:float32`; without
one, the server's default `auto`). For each mode the same model is loaded afresh as the server loads
it (its linear layers quantized, with the dense copies `--linear-kernels` keeps), then:
- perplexity over a text that CPython's own distribution ships (its LICENSE.txt, about 3,000 tokens
  of English), in non-overlapping windows, teacher-forced through the serving runner: each window is
  read in chunks of `PERPLEXITY_CHUNK` tokens, every chunk after the first attending to the ones
  before it through the paged KV cache, in the mode's KV dtype;
- greedy answers to a fixed set of chat prompts through the engine, compared token by token with
  float32's: how many answers are identical and how far, on average, an answer agrees before it parts.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sysconfig
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from app.process.engine_factory import build_engine, build_runner, load_model_for
from app.process.flags import add_model_flags, settings_from_args
from config.settings import Settings
from contract.plan import SamplingParams, ScheduledSequence
from gpu.models import LoadedModel
from gpu.runner import ModelRunner
from loadtest.bench_output import format_table, write_report
from scheduling.request import Request, RequestId

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "What is 17 times 23?",
    "Give me a short tip for learning a new language.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "Name the planets of the solar system in order.",
    "What does a compiler do?",
    "Suggest a name for a friendly robot.",
    "How do I boil an egg?",
    "What is photosynthesis?",
    "Describe a cat to someone who has never seen one.",
    "What is the difference between weather and climate?",
    "Write one sentence that uses the word 'serendipity'.",
)


def corpus_text() -> str:
    """A fixed English text present wherever Python is: the interpreter's license and its history."""
    return (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")


@dataclass(slots=True)
class ModeQuality:
    mode: str
    perplexity: float
    answers: list[list[int]]
    seconds: float
    exact_answers: float = 1.0  # share of answers identical to float32's
    agreement_before_parting: float = 1.0  # mean share of an answer's tokens before it first differs


PERPLEXITY_CHUNK = 128  # tokens per prompt chunk: a window's later chunks read the earlier ones' KV


@torch.inference_mode()
def perplexity(runner: ModelRunner, token_ids: list[int], window: int) -> float:
    """exp(mean next-token negative log likelihood) over consecutive windows of the text."""
    total_nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        text = token_ids[start : start + window + 1]
        if len(text) < 2:
            break
        logits = window_logits(runner, text[:-1])
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(text[1:], device=logits.device), reduction="sum")
        total_nll, count = total_nll + float(nll), count + len(text) - 1
    return math.exp(total_nll / count)


def window_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """The logits after every token of a fresh prompt, read chunk by chunk into the first blocks of the pool."""
    block_size = runner.geometry.block_size
    table = tuple(range(-(-len(tokens) // block_size)))
    chunks = []
    for start in range(0, len(tokens), PERPLEXITY_CHUNK):
        chunk = tokens[start : start + PERPLEXITY_CHUNK]
        sequence = ScheduledSequence("perplexity", chunk, start, table, False, SamplingParams())
        chunks.append(runner.compute_logits([sequence], extra_rows=range(len(chunk))))
    return torch.cat(chunks)


async def greedy_answers(settings: Settings, loaded: LoadedModel, max_tokens: int) -> list[list[int]]:
    engine, _ = build_engine(settings, loaded)
    tokenizer = loaded.tokenizer
    await engine.start()

    async def answer(text: str) -> list[int]:
        prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
        tokens: list[int] = []
        async for event in engine.submit(Request(RequestId(uuid.uuid4().hex), prompt, max_tokens)):
            tokens.extend(event.new_token_ids)
        return tokens

    try:
        return list(await asyncio.gather(*(answer(text) for text in PROMPTS)))
    finally:
        await engine.shutdown()


def settings_of_mode(settings: Settings, mode: str) -> Settings:
    quantization, _, kv_dtype = mode.partition(":")
    return settings.model_copy(update={"quantization": quantization, "kv_cache_dtype": kv_dtype or "auto"})


def measure_mode(settings: Settings, mode: str, max_tokens: int, window: int) -> ModeQuality:
    started = time.perf_counter()
    mode_settings = settings_of_mode(settings, mode)
    loaded = load_model_for(mode_settings)
    text_ids = loaded.tokenizer.encode(corpus_text())
    runner = build_runner(mode_settings, loaded)
    try:
        ppl = perplexity(runner, text_ids, window)
    finally:
        runner.close()
    answers = asyncio.run(greedy_answers(mode_settings, loaded, max_tokens))
    return ModeQuality(mode, ppl, answers, time.perf_counter() - started)


def compare_with(reference: ModeQuality, other: ModeQuality) -> None:
    exact, parts = 0, []
    for ref, got in zip(reference.answers, other.answers, strict=True):
        common = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got)))
        exact += ref == got
        parts.append(common / max(len(ref), 1))
    other.exact_answers = exact / len(reference.answers)
    other.agreement_before_parting = sum(parts) / len(parts)


def run_command(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = [measure_mode(settings, mode, args.max_tokens, args.window) for mode in modes]
    for result in results[1:]:
        compare_with(results[0], result)
    rows = [["mode", "perplexity", "vs first", "exact answers", "agreement before parting", "seconds"]]
    rows += [[r.mode, f"{r.perplexity:.3f}", f"{r.perplexity / results[0].perplexity:.3f}",
              f"{r.exact_answers:.2f}", f"{r.agreement_before_parting:.2f}", f"{r.seconds:.0f}"] for r in results]
    print(format_table(rows))
    write_report(args.out, report(settings, results, args))
    return 0


def report(settings: Settings, results: list[ModeQuality], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": settings.model, "dtype": settings.dtype, "max_tokens": args.max_tokens, "window": args.window,
        "num_prompts": len(PROMPTS), "corpus": "stdlib LICENSE.txt",
        "modes": [{k: v for k, v in asdict(r).items() if k != "answers"} for r in results],
    }


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("quality", help="perplexity and greedy agreement of each quantization mode")
    add_model_flags(parser)
    parser.add_argument("--modes", default="none:float32,none,int8,int4:float32,int4",
                        help="quantization[:kv cache dtype], comma separated; the first is the reference")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--out", help="write the JSON report here")
    # Eager: the numbers, not the compile, are measured here (and nothing is compiled per mode).
    parser.set_defaults(dtype="float32", kv_cache_bytes=256 * 2**20, compile_mode="eager", handler=run_command)
