"""The flags of every command that loads a model (serve, generate, the in-process benchmarks), and
the settings they make. Its own module so that the commands can share it without importing each other."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from config.settings import Settings, load_settings


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model spec: smollm2-135m, builtin:tiny, builtin:small, "
                                        "a checkpoint dir or a .gguf file")
    parser.add_argument("--config", help="a TOML settings file")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--quantization", choices=["auto", "none", "int8", "int4"],
                        help="weight-only quantization of the linear layers; auto (the default) keeps a GGUF "
                             "model's own precision")
    parser.add_argument("--linear-kernels", dest="linear_kernels", choices=["auto", "auto-fbgemm", "packed"],
                        help="auto (the default): quantized layers keep a dense copy for large steps where "
                             "this machine multiplies it faster (measured at start, cached); auto-fbgemm: "
                             "int8 copies on fbgemm's kernels among the candidates; packed: no copy")
    parser.add_argument("--kv-cache-bytes", type=int, help="the KV pool in bytes (default: a share of free memory)")
    parser.add_argument("--kv-cache-memory-fraction", type=float,
                        help="the KV pool's share of the memory free after loading, without --kv-cache-bytes")
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the KV cache's dtype (default auto: the fastest this machine reads)")
    parser.add_argument("--kv-host-cache-bytes", type=int,
                        help="the prefix cache's host-memory tier: blocks leaving the KV pool are kept here")
    parser.add_argument("--kv-disk-cache-path", help="the prefix cache's disk tier: a folder kept across restarts")
    parser.add_argument("--kv-disk-cache-bytes", type=int, help="the disk tier's size (default 8 GiB)")
    parser.add_argument("--compile", dest="compile_mode", choices=["eager", "default", "max"],
                        help="the forward run eagerly or compiled by inductor (default; max: autotuned "
                             "GEMMs and a C++ wrapper); cached on disk")
    parser.add_argument("--compile-scope", dest="compile_scope", choices=["auto", "model", "layer"],
                        help="one graph for the whole step, or one decoder layer's graph shared by every layer "
                             "(regional: compiles far faster); auto: the faster step in the mode")
    parser.add_argument("--compile-wait", dest="compile_wait", action="store_true", default=None,
                        help="compile the forward before serving (default: serve eagerly at once while a child "
                             "process compiles, then switch to the compiled forward)")
    parser.add_argument("--enable-lora", action="store_true", default=None,
                        help="serve LoRA adapters (peft folders) next to the base model")
    parser.add_argument("--max-loras", type=int, help="adapter slots on the device (default 4)")
    parser.add_argument("--max-cpu-loras", type=int, help="adapters kept read in CPU memory (default 2 x max-loras)")
    parser.add_argument("--max-lora-rank", type=int, help="the largest adapter rank served (default 16)")
    parser.add_argument("--queue-order", dest="queue_order", choices=["fcfs", "hrrn", "srpt", "lpm"],
                        help="the order inside each tenant's line (default srpt; docs/preemption.md)")
    parser.add_argument("--long-prefill-token-threshold", dest="long_prefill_token_threshold", type=int,
                        help="a running prompt's chunk while other prompts of its class wait (default: a quarter "
                             "of the step's tokens; the step's tokens: first come, first computed)")
    parser.add_argument("--speculative-config", dest="speculative_config", metavar="JSON",
                        help='speculative decoding as vLLM takes it, e.g. \'{"method": "suffix", '
                             '"num_speculative_tokens": 4}\' (methods: ngram, suffix, draft_model with "model"); '
                             '"none" turns it off (default: ngram, 8 tokens)')
    parser.add_argument("--lora-modules", nargs="+", action="extend", metavar="NAME=PATH",
                        help="an adapter served from start-up to every tenant; repeatable")


MODEL_FLAG_KEYS = ("model", "device", "dtype", "quantization", "linear_kernels", "max_num_seqs",
                   "max_num_batched_tokens", "kv_cache_bytes", "kv_cache_memory_fraction", "block_size",
                   "kv_cache_dtype",
                   "compile_mode", "compile_scope", "compile_wait", "kv_host_cache_bytes", "kv_disk_cache_path",
                   "kv_disk_cache_bytes", "enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank", "lora_modules",
                   "speculative_config", "queue_order", "long_prefill_token_threshold")


def settings_from_args(args: argparse.Namespace, extra_keys: Sequence[str] = ()) -> Settings:
    overrides = {key: getattr(args, key, None) for key in (*MODEL_FLAG_KEYS, *extra_keys)}
    return load_settings(getattr(args, "config", None), overrides=overrides)
