"""The default model, SmolLM2-135M-Instruct: the engine agrees with Hugging Face and answers sensibly."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu.models import (
    SMOLLM2_GGUF,
    SMOLLM2_SPEC,
    LoadedModel,
    ModelSpecError,
    convert_gguf,
    convert_smollm2,
    gguf_digest,
    load_model,
    smollm2_dir,
)
from gpu.quantization import int4_groups
from tests.factories import assert_kv_all_free, collect, make_engine, make_request, running, tokens_of
from tests.gpu.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
)
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2(model_cache_dir: Path) -> LoadedModel:
    return load_model(SMOLLM2_SPEC, device="cpu", dtype="float32", cache_dir=str(model_cache_dir))


@pytest.fixture(scope="module")
def smollm2_reference(model_cache_dir: Path) -> Any:
    """A second copy of the converted checkpoint with transformers' own attention; EOS not special."""
    model = AutoModelForCausalLM.from_pretrained(str(convert_smollm2(model_cache_dir)), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


async def test_greedy_matches_hf(smollm2: LoadedModel, smollm2_reference: Any) -> None:
    prompts = [smollm2.tokenizer.encode(text) for text in PROMPTS]
    expected = [hf_greedy(smollm2_reference, prompt, MAX_TOKENS) for prompt in prompts]
    engine = make_engine(smollm2, num_blocks=32, block_size=16)
    async with running(engine):
        results = await asyncio.gather(*(collect(engine.submit(make_request(p, MAX_TOKENS))) for p in prompts))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    assert [tokens_of(events) for events in results] == expected


async def test_chat_knows_the_capital_of_france(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine = make_engine(smollm2, num_blocks=32, block_size=16)
    async with running(engine):
        request = make_request(prompt, 48, stop_token_ids=tokenizer.eos_token_ids)
        events = await collect(engine.submit(request))
    answer = tokenizer.decode(tokens_of(events))
    assert "Paris" in answer, answer
    assert events[-1].finish_reason == "stop"  # the end-of-turn token ends it, well before max_tokens


def q4_1_integers(raw: np.ndarray) -> torch.Tensor:
    """GGUF Q4_1 rows as raw bytes -> [rows, cols] integers 0..15. Each block of 32 weights is a float16
    scale, a float16 minimum and 16 bytes: weight j in the low nibble of byte j, weight j + 16 in the high."""
    blocks = torch.from_numpy(raw.reshape(raw.shape[0], -1, 20)[:, :, 4:].astype(np.int32))
    return torch.cat([blocks & 0xF, blocks >> 4], dim=-1).reshape(raw.shape[0], -1)


def test_int4_packs_the_gguf_q4_1_integers_as_they_are(smollm2: LoadedModel) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(smollm2_dir() / SMOLLM2_GGUF))
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    expected = q4_1_integers(np.asarray(raw.data))
    weight = smollm2.model.model.layers[0].mlp.down_proj.weight.detach()
    got, _, _ = int4_groups(weight)
    assert got.shape == expected.shape == (576, 1536)
    assert float((got == expected).float().mean()) > 0.999  # a handful may sit on a float16 rounding edge


async def test_a_gguf_path_serves_the_same_model(smollm2: LoadedModel, model_cache_dir: Path) -> None:
    """`--model FILE.gguf`: the same weights, tokenizer and chat template as the packaged default, from
    the one conversion of that file (its digest names it, whichever spec loads it)."""
    path = smollm2_dir() / SMOLLM2_GGUF
    assert convert_gguf(path, model_cache_dir) == convert_smollm2(model_cache_dir)
    from_file = load_model(str(path), device="cpu", dtype="float32", cache_dir=str(model_cache_dir))
    prompt = smollm2.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert from_file.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}]) == prompt
    answers = []
    for loaded in (smollm2, from_file):
        engine = make_engine(loaded, num_blocks=32, block_size=16)
        async with running(engine):
            answers.append(tokens_of(await collect(engine.submit(make_request(prompt, 12)))))
    assert answers[0] == answers[1]


def test_a_gguf_conversion_is_named_by_the_files_bytes(tmp_path: Path) -> None:
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(b"GGUF one")
    second.write_bytes(b"GGUF one")
    same = gguf_digest(first) == gguf_digest(second)
    second.write_bytes(b"GGUF two")

    assert same and gguf_digest(first) != gguf_digest(second)
    with pytest.raises(ModelSpecError, match="GGUF file not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path)
