"""`fairlane bench make-checkpoint`: a Llama checkpoint of a size people serve, for the serve comparison.

Nothing can be downloaded here, so the 1.1B model of docs/benchmarks/serve.md is made: TinyLlama's
shape (hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632) from transformers' LlamaConfig,
seeded random weights, and the default model's tokenizer and chat template, saved as a transformers
checkpoint in float32. fairlane serves the folder (`--model DIR --quantization int4`); llama.cpp's
`convert_hf_to_gguf.py` and `llama-quantize` make its GGUF files from the same folder. Its answers are
noise: the comparison runs with `ignore_eos` and measures time, not text.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch

from app.process.flags import settings_from_args
from gpu.models import convert_smollm2

# TinyLlama-1.1B's shape.
SHAPE = {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
         "intermediate_size": 5632, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def add_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("make-checkpoint", help="a seeded 1.1B Llama (TinyLlama's shape) with the default "
                                                           "model's tokenizer, for the serve comparison")
    parser.add_argument("--out", required=True, help="the checkpoint's folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(handler=run_command)


def make_checkpoint(out: Path, seed: int, tokenizer_dir: Path, shape: dict[str, Any] | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    source = LlamaConfig.from_pretrained(tokenizer_dir)
    config = LlamaConfig(**(shape or SHAPE), vocab_size=source.vocab_size, bos_token_id=source.bos_token_id,
                         eos_token_id=source.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def run_command(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    out = make_checkpoint(Path(args.out), args.seed, convert_smollm2(Path(settings.model_cache_dir)))
    print(f"wrote {out}")
    return 0
