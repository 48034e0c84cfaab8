"""Every decoder architecture of tests/gpu/architectures.py, loaded from its checkpoint with `--model PATH`,
answers exactly what transformers' own eager `generate` does (the same greedy tokens, each logprob within
1e-3) for prompts longer than its window, through chunked prefill, prefix-cache hits and preemption by
swap and by recompute; and what the paged attention cannot compute is refused at load, by name."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from contract.plan import SamplingParams
from gpu.attention import UnsupportedAttention, paged_attention_forward
from gpu.capabilities import check_architecture
from gpu.models import LoadedModel, context_length_of, load_model
from gpu.quantization import PackedLinear
from scheduling.request import TokenEvent
from scheduling.scheduler import SchedulerConfig
from tests.factories import assert_kv_all_free, collect, make_engine, make_request, make_runner, running, tokens_of
from tests.gpu.architectures import CONFIGS, WINDOW, WINDOWED, Reference, prompts, reference, write_checkpoint

NEW_TOKENS = 8
PROMPT_LENGTH = 3 * WINDOW - 3  # longer than every window, not a whole number of blocks
LOGPROB_TOLERANCE = 1e-3


def requests_of(prompt_list: Sequence[list[int]]) -> list[Any]:
    return [make_request(prompt, NEW_TOKENS, sampling=SamplingParams(logprobs=1)) for prompt in prompt_list]


async def served(engine: Any, *waves: Sequence[list[int]]) -> list[list[TokenEvent]]:
    """Each wave's prompts submitted together, once the wave before has finished."""
    results: list[list[TokenEvent]] = []
    async with running(engine):
        for wave in waves:
            streams = [engine.submit(request) for request in requests_of(wave)]
            results += await asyncio.gather(*(collect(stream) for stream in streams))
        assert await engine.wait_idle(timeout=10)
    assert_kv_all_free(engine)
    return results


def assert_matches(results: Sequence[list[TokenEvent]], references: Sequence[Reference]) -> None:
    for events, expected in zip(results, references, strict=True):
        assert tokens_of(events) == expected.tokens
        logprobs = [entry.logprob for event in events for entry in event.logprobs]
        assert logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_TOLERANCE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each family's checkpoint folder and the transformers model it was saved from, made on first use."""
    made: dict[str, tuple[Path, Any]] = {}

    class Lazy(dict[str, tuple[Path, Any]]):
        def __missing__(self, family: str) -> tuple[Path, Any]:
            folder = tmp_path_factory.mktemp(family)
            self[family] = (folder, write_checkpoint(family, folder))
            return self[family]

    return Lazy(made)


def load(folder: Path) -> LoadedModel:
    return load_model(str(folder), device="cpu", dtype="float32")


@pytest.mark.parametrize("family", sorted(CONFIGS))
async def test_chunked_prefill_and_prefix_hits_match_transformers(
        family: str, checkpoints: dict[str, tuple[Path, Any]]) -> None:
    folder, model = checkpoints[family]
    loaded = load(folder)
    assert loaded.max_model_len == 256  # the model's positions, not its window
    shared = prompts(3, PROMPT_LENGTH, shared=2 * WINDOW)
    references = [reference(model, prompt, NEW_TOKENS) for prompt in shared]
    config = SchedulerConfig(max_num_batched_tokens=WINDOW)  # every prompt is read in chunks
    engine = make_engine(loaded, num_blocks=64, block_size=4, config=config, kv_dtype=torch.float32)
    results = await served(engine, shared[:1], shared[1:])
    assert_matches(results, references)
    assert results[0][-1].num_cached_tokens == 0
    assert all(events[-1].num_cached_tokens >= WINDOW for events in results[1:])


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
async def test_preemption_matches_transformers(family: str, mode: str,
                                               checkpoints: dict[str, tuple[Path, Any]]) -> None:
    folder, model = checkpoints[family]
    distinct = prompts(3, PROMPT_LENGTH)
    references = [reference(model, prompt, NEW_TOKENS) for prompt in distinct]
    # 14 blocks of 4 tokens: each request (29 tokens, 8 blocks) fits alone, not three together.
    engine = make_engine(load(folder), num_blocks=14, block_size=4, num_cpu_blocks=32, kv_dtype=torch.float32,
                         config=SchedulerConfig(preemption_mode=mode))
    assert_matches(await served(engine, distinct), references)
    assert engine.stats()["preemptions"][mode] > 0


def test_windows_softcaps_and_sinks_reach_the_attention(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """The runner's probe finds each layer's features where the model code passes them."""
    found = {}
    for family in ("gemma2", "gemma3_text", "gpt_oss", "mistral", "llama"):
        runner = make_runner(load(checkpoints[family][0]), num_blocks=8, block_size=4)
        found[family] = [layer.describe() for layer in runner.attention]
    assert found["gemma2"] == [f"window {WINDOW}, softcap 0.5", "softcap 0.5"]
    assert found["gemma3_text"] == [f"window {WINDOW}", f"window {WINDOW}", "full"]
    assert found["gpt_oss"] == [f"window {WINDOW}, sinks", "sinks"]
    assert found["mistral"] == [f"window {WINDOW}", f"window {WINDOW}"]
    assert found["llama"] == ["full", "full"]


def test_the_context_is_the_models_not_its_window() -> None:
    for family in sorted(WINDOWED):
        assert context_length_of(CONFIGS[family]()) == 256


def test_an_unknown_attention_keyword_is_refused() -> None:
    class Attention(torch.nn.Module):
        layer_idx = 3

    query = torch.zeros(1, 4, 2, 16)
    with pytest.raises(UnsupportedAttention, match="layer 3 passes chunk_size"):
        paged_attention_forward(Attention(), query, query, query, None, paged_metadata=object(),  # type: ignore[arg-type]
                                chunk_size=64)


def test_a_model_passing_an_unknown_keyword_is_refused_at_load(checkpoints: dict[str, tuple[Path, Any]],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load(checkpoints["llama"][0])
    forward = loaded.model.forward

    def with_extra_keyword(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs, attention_chunk=16)

    monkeypatch.setattr(loaded.model, "forward", with_extra_keyword)
    with pytest.raises(UnsupportedAttention, match="layer 0 passes attention_chunk"):
        make_engine(loaded, num_blocks=8, block_size=4)


@pytest.mark.parametrize(("changes", "refusal"), [
    ({"layer_types": ["sliding_attention", "linear_attention"]}, "layer 1 is 'linear_attention'"),
    ({"kv_lora_rank": 32}, "multi-head latent attention"),
])
def test_unsupported_architectures_are_refused_by_name(changes: dict[str, Any], refusal: str) -> None:
    config = CONFIGS["llama"]()
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedAttention, match=refusal):
        check_architecture("tiny", config)


def test_a_quantized_moe_keeps_its_router_and_experts_in_float(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """Quantization packs the nn.Linear layers (attention, the LM head); transformers' routers and fused
    experts are not nn.Linear, so they keep the checkpoint's float weights."""
    loaded = load_model(str(checkpoints["qwen3_moe"][0]), device="cpu", dtype="float32", quantization="int8")
    packed = {name for name, module in loaded.model.named_modules() if isinstance(module, PackedLinear)}
    assert "model.layers.0.self_attn.q_proj" in packed
    assert not any(".gate" in name or ".experts" in name for name in packed)
    router = loaded.model.get_submodule("model.layers.0.mlp.gate")
    assert router.weight.dtype == torch.float32
    assert len(make_runner(loaded, num_blocks=8, block_size=4).attention) == 2
