"""Reference outputs straight from Hugging Face transformers: generate and a plain forward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu.tokenizer import ByteTokenizer


@dataclass(slots=True, frozen=True)
class GreedyCase:
    """A prompt, how many tokens to generate, and what HF generate produced for it alone."""

    prompt: list[int]
    max_tokens: int
    expected: list[int]


TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
    "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow. "
    "Über café naïve résumé, 東京 and Zürich: bytes beyond ASCII are tokens too. "
    "In 1969 the first message on the network was 'lo' before the system crashed."
)
# Prompt lengths from a single token to about two hundred, each with its own number of new tokens.
PROMPT_LENGTHS = (1, 2, 5, 9, 16, 17, 31, 33, 48, 64, 77, 100, 150, 201)
MAX_TOKENS = (8, 1, 24, 3, 16, 32, 12, 5, 20, 9, 30, 6, 14, 2)


def byte_prompt(length: int, offset: int = 0) -> list[int]:
    """BOS and then length - 1 bytes of TEXT starting at offset."""
    data = TEXT.encode("utf-8")
    body = [data[(offset + i) % len(data)] for i in range(length - 1)]
    return [ByteTokenizer.BOS, *body]


def hf_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The tokens HF generate picks greedily for the prompt alone (no EOS stop if the model has none)."""
    input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False)
    return [int(t) for t in output[0, input_ids.shape[1]:].tolist()]


def hf_logits(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 logits of one plain forward over the whole sequence."""
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        logits: torch.Tensor = model(input_ids=input_ids).logits[0].float()
    return logits


def greedy_cases(model: Any) -> list[GreedyCase]:
    return [
        GreedyCase(prompt, max_tokens, hf_greedy(model, prompt, max_tokens))
        for prompt, max_tokens in (
            (byte_prompt(length, offset=7 * i), max_tokens)
            for i, (length, max_tokens) in enumerate(zip(PROMPT_LENGTHS, MAX_TOKENS, strict=True))
        )
    ]
