"""Tiny random models of the decoder architectures users serve, each built from its transformers config
class and saved as a checkpoint with a word-level tokenizer, and what transformers' own eager `generate`
answers for them: the reference the engine must match token for token, logprob for logprob.

Each family that has a sliding window gets one of WINDOW tokens, shorter than the test prompts, and the
features that change the logits (Gemma 2's softcap, gpt-oss's sinks) are sized so that they do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

WINDOW = 8
VOCAB = 96
SHAPE: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                         "max_position_embeddings": 256, "initializer_range": 0.1, "eos_token_id": 1,
                         "bos_token_id": 0, "pad_token_id": 0}
MOE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _config(name: str, **changes: Any) -> Callable[[], Any]:
    return lambda: getattr(transformers, name)(**{**SHAPE, **changes})


CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": _config("LlamaConfig"),
    "mistral": _config("MistralConfig", sliding_window=WINDOW),
    "qwen2": _config("Qwen2Config"),  # q/k/v projections with bias
    "qwen3": _config("Qwen3Config"),  # QK norms
    "qwen3_moe": _config("Qwen3MoeConfig", num_experts=4, **MOE),
    "gemma": _config("GemmaConfig"),
    "gemma2": _config("Gemma2Config", sliding_window=WINDOW, attn_logit_softcapping=0.5, query_pre_attn_scalar=16),
    "gemma3_text": _config("Gemma3TextConfig", num_hidden_layers=3, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "phi3": _config("Phi3Config"),  # fused qkv_proj and gate_up_proj
    "phi3_window": _config("Phi3Config", sliding_window=WINDOW, partial_rotary_factor=0.5),
    "granite": _config("GraniteConfig", attention_multiplier=0.5, embedding_multiplier=2.0),
    "olmo2": _config("Olmo2Config"),
    "smollm3": _config("SmolLM3Config"),  # layers without rotary positions
    "mixtral": _config("MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": _config("GptOssConfig", sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                       layer_types=["sliding_attention", "full_attention"]),
}
WINDOWED = frozenset({"mistral", "gemma2", "gemma3_text", "phi3_window", "gpt_oss"})


@dataclass(slots=True)
class Reference:
    """What transformers' eager generate picks greedily, and the logprob of each pick."""

    tokens: list[int]
    logprobs: list[float]


def build_model(family: str, seed: int = 7) -> Any:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="eager").eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):  # zero at init: drawn here, so that the sinks move the logits
                parameter.normal_(0.0, 1.0)
    return model


def write_checkpoint(family: str, directory: Path) -> Any:
    """A small random model of the family and a word-level tokenizer, saved as a checkpoint dir."""
    model = build_model(family)
    model.save_pretrained(str(directory))
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    word_level = Tokenizer(WordLevel(vocab, unk_token="w2"))
    word_level.pre_tokenizer = Whitespace()  # type: ignore[assignment]
    PreTrainedTokenizerFast(tokenizer_object=word_level, bos_token="<s>", eos_token="</s>").save_pretrained(
        str(directory))
    return model


def reference(model: Any, prompt: list[int], new_tokens: int) -> Reference:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                output_logits=True, return_dict_in_generate=True)
    tokens = [int(t) for t in output.sequences[0, len(prompt):]]
    logprobs = [float(torch.log_softmax(logits[0].float(), -1)[token])
                for logits, token in zip(output.logits, tokens, strict=True)]
    return Reference(tokens, logprobs)


def prompts(count: int, length: int, shared: int = 0) -> list[list[int]]:
    """Deterministic prompts of word ids (never BOS or EOS); the first `shared` tokens common to all."""
    head = [2 + (i * 13 + 5) % (VOCAB - 2) for i in range(shared)]
    return [[0, *head, *(2 + (i * 7 + n * 31 + 3) % (VOCAB - 2) for i in range(length - shared))]
            for n in range(count)]
