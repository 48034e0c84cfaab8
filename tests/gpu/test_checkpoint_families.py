"""Local Hugging Face checkpoint directories of the Llama, Qwen2 and Mistral families load through
`--model PATH` and generate exactly what transformers' own `generate` does."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config

from gpu.models import context_length_of, load_model
from scheduling.request import Request, RequestId
from tests.factories import collect, make_engine, running, tokens_of

SHAPE: dict[str, Any] = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                         "initializer_range": 0.1, "eos_token_id": 1, "bos_token_id": 0}
CONFIGS: dict[str, Any] = {
    "llama": lambda: LlamaConfig(**SHAPE),
    "qwen2": lambda: Qwen2Config(**SHAPE),  # q/k/v projections with bias
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=None),
}
PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 42] * 7, [88]]
NEW_TOKENS = 10


def write_checkpoint(family: str, directory: Path) -> Any:
    """A small random model of the family and a word-level tokenizer, saved as a checkpoint dir."""
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    model.save_pretrained(str(directory))
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, SHAPE["vocab_size"])}}
    word_level = Tokenizer(WordLevel(vocab, unk_token="w2"))
    word_level.pre_tokenizer = Whitespace()  # type: ignore[assignment]
    PreTrainedTokenizerFast(tokenizer_object=word_level, bos_token="<s>", eos_token="</s>").save_pretrained(
        str(directory))
    return model


def reference_tokens(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return [int(t) for t in output[0, len(prompt):]]


@pytest.mark.parametrize("family", sorted(CONFIGS))
async def test_checkpoint_directory_matches_transformers(family: str, tmp_path: Path) -> None:
    reference = write_checkpoint(family, tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.model.config.model_type == family
    assert 1 in loaded.tokenizer.eos_token_ids
    engine = make_engine(loaded, num_blocks=64, block_size=4)
    async with running(engine):
        streams = [engine.submit(Request(RequestId(f"{family}-{i}"), prompt, NEW_TOKENS))
                   for i, prompt in enumerate(PROMPTS)]
        outputs = [tokens_of(events) for events in await asyncio.gather(*(collect(s) for s in streams))]
    assert outputs == [reference_tokens(reference, prompt) for prompt in PROMPTS]


def test_a_sliding_window_caps_the_context() -> None:
    assert context_length_of(MistralConfig(**SHAPE, sliding_window=128)) == 128
    assert context_length_of(MistralConfig(**SHAPE, sliding_window=None)) == 512
    assert context_length_of(Qwen2Config(**SHAPE, sliding_window=128, use_sliding_window=False)) == 512
