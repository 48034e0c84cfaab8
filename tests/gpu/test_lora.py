"""LoRA adapters: a `peft` adapter read from its folder computes what `peft`'s own model computes, tokens of
different adapters and of the base model mix in one forward, and a bad folder is an error naming its file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

from contract.plan import SamplingParams, ScheduledSequence
from gpu.compiled import CompileConfig
from gpu.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    BASE_SLOT,
    AdapterError,
    LoraServing,
    LoraSlots,
    read_adapter,
)
from gpu.models import load_model
from gpu.quantization import quantize_linears
from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of
from tests.gpu.architectures import build_model
from tests.gpu.reference import byte_prompt
from tests.isolation import in_fresh_process

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model() -> Any:
    return load_model("builtin:tiny", device="cpu", dtype="float32").model


def save_adapter(folder: Path, seed: int, rank: int = 4, alpha: int = 8, **config: Any) -> Any:
    """A peft model on builtin:tiny with random A and B (fixed seed), saved as peft saves it."""
    peft_model = get_peft_model(base_model(), LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS,
                                                         init_lora_weights=False, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(str(folder))
    return peft_model.eval()


@torch.inference_mode()
def logits_of(model: Any, token_ids: list[int]) -> torch.Tensor:
    logits: torch.Tensor = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return logits


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: (root / name, save_adapter(root / name, seed, rank))
            for name, seed, rank in (("one", 1, 4), ("two", 2, 8))}


@pytest.fixture(scope="module")
def adapter_folders(adapters: dict[str, tuple[Path, Any]]) -> dict[str, Path]:
    """The adapters' folders alone: what a test in a process of its own can be given."""
    return {name: folder for name, (folder, _) in adapters.items()}


def served(adapters: dict[str, tuple[Path, Any]], model: Any = None, num_slots: int = 2) -> tuple[Any, LoraSlots]:
    model = base_model() if model is None else model
    slots = LoraSlots(model, num_slots=num_slots, max_rank=8)
    for slot, (name, (folder, _)) in enumerate(adapters.items()):
        slots.place(slot, read_adapter(name, folder, model, max_rank=8))
    return model, slots


def test_an_adapter_computes_what_peft_computes(adapters: dict[str, tuple[Path, Any]]) -> None:
    model, slots = served(adapters)
    text = byte_prompt(60)
    for slot, (_, peft_model) in enumerate(adapters.values()):
        slots.select(torch.full((len(text),), slot))
        expected = logits_of(peft_model, text)
        torch.testing.assert_close(logits_of(model, text), expected, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(expected, logits_of(base_model(), text), atol=1e-2)  # the adapter matters


def test_base_tokens_get_no_delta(adapters: dict[str, tuple[Path, Any]]) -> None:
    model, slots = served(adapters)
    text = byte_prompt(40)
    slots.select(torch.full((len(text),), BASE_SLOT))
    assert slots.rows.mask is None
    torch.testing.assert_close(logits_of(model, text), logits_of(base_model(), text), rtol=0, atol=0)


def test_tokens_of_different_adapters_mix_in_one_layer(adapters: dict[str, tuple[Path, Any]]) -> None:
    """Each row of a mixed batch gets exactly its own adapter's output, as if it ran alone."""
    _, slots = served(adapters)
    layer = slots.layers["model.layers.1.mlp.down_proj"]
    x = torch.randn(6, layer.in_features, generator=torch.Generator().manual_seed(0))
    token_slots = torch.tensor([0, BASE_SLOT, 1, 1, 0, BASE_SLOT])
    slots.select(token_slots)
    mixed = layer(x)
    for row, slot in enumerate(token_slots.tolist()):
        slots.select(torch.tensor([slot]))
        # A GEMM of six rows and one of a single row may sum in another order (AVX2 kernels do): 1e-6 apart.
        torch.testing.assert_close(mixed[row], layer(x[row:row + 1])[0], rtol=1e-4, atol=1e-5)


def test_a_cleared_slot_is_the_base_model(adapters: dict[str, tuple[Path, Any]]) -> None:
    model, slots = served(adapters)
    slots.clear(0)
    text = byte_prompt(30)
    slots.select(torch.zeros(len(text), dtype=torch.long))
    torch.testing.assert_close(logits_of(model, text), logits_of(base_model(), text), rtol=1e-6, atol=1e-6)
    assert slots.resident == [None, "two"]


def test_rslora_scaling_matches_peft(tmp_path: Path) -> None:
    peft_model = save_adapter(tmp_path / "rs", seed=3, rank=8, alpha=4, use_rslora=True)
    model, slots = served({"rs": (tmp_path / "rs", peft_model)}, num_slots=1)
    text = byte_prompt(30)
    slots.select(torch.zeros(len(text), dtype=torch.long))
    torch.testing.assert_close(logits_of(model, text), logits_of(peft_model, text), rtol=1e-4, atol=1e-4)


def test_an_adapter_over_a_quantized_base_adds_its_delta(adapters: dict[str, tuple[Path, Any]]) -> None:
    """int8 weights under the adapter: the delta is the same float delta as over float weights."""
    quantized = base_model()
    quantize_linears(quantized, "int8")
    model, slots = served(adapters, quantized)
    text = byte_prompt(30)
    slots.select(torch.full((len(text),), BASE_SLOT))
    base = logits_of(model, text)
    slots.select(torch.zeros(len(text), dtype=torch.long))
    with_adapter = logits_of(model, text)
    float_model, float_slots = served(adapters)
    float_slots.select(torch.full((len(text),), BASE_SLOT))
    float_base = logits_of(float_model, text)
    float_slots.select(torch.zeros(len(text), dtype=torch.long))
    float_delta = logits_of(float_model, text) - float_base
    relative = (with_adapter - base - float_delta).norm() / float_delta.norm()
    assert relative < 0.1, float(relative)


def corrupt(source: Path, target: Path, **config_changes: Any) -> Path:
    target.mkdir()
    config = json.loads((source / ADAPTER_CONFIG).read_text())
    config.update(config_changes)
    (target / ADAPTER_CONFIG).write_text(json.dumps(config))
    (target / ADAPTER_WEIGHTS).write_bytes((source / ADAPTER_WEIGHTS).read_bytes())
    return target


def test_bad_adapter_folders_are_errors_that_name_the_file(adapters: dict[str, tuple[Path, Any]],
                                                           tmp_path: Path) -> None:
    source, _ = adapters["two"]
    model = base_model()
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match=f"{ADAPTER_CONFIG} is missing"):
        read_adapter("empty", tmp_path / "empty", model, max_rank=8)
    with pytest.raises(AdapterError, match="r=8 is over max_lora_rank=4"):
        read_adapter("two", source, model, max_rank=4)
    with pytest.raises(AdapterError, match="DoRA"):
        read_adapter("dora", corrupt(source, tmp_path / "dora", use_dora=True), model, max_rank=8)
    with pytest.raises(AdapterError, match="has A"):  # the config says rank 4, the tensors are rank 8
        read_adapter("ranks", corrupt(source, tmp_path / "ranks", r=4), model, max_rank=8)
    torn = corrupt(source, tmp_path / "torn")
    (torn / ADAPTER_WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match=f"{ADAPTER_WEIGHTS} cannot be read"):
        read_adapter("torn", torn, model, max_rank=8)
    small = load_model("builtin:small", device="cpu", dtype="float32").model
    with pytest.raises(AdapterError, match="the base model needs"):
        read_adapter("two", source, small, max_rank=8)


@pytest.mark.slow
@in_fresh_process  # what dynamo compiles here stays out of the tests that follow
def test_a_compiled_runner_serves_adapters_in_one_graph(adapter_folders: dict[str, Path], tmp_path: Path) -> None:
    """The slot mask is an input of the compiled graph: steps of adapters, of the base model and of a mix
    give what the eager runner gives, through one graph and no compilation after start-up."""
    runners = []
    for mode in ("eager", "default"):
        loaded = load_model("builtin:tiny", device="cpu", dtype="float32")
        budget = RunnerBudget(block_size=16, kv_cache_bytes=64 * kv_shape_of(loaded, 16).bytes_per_block,
                              swap_space_bytes=0)
        runner = ModelRunner(loaded, budget, CompileConfig(mode, str(tmp_path)), LoraServing(max_loras=2, max_rank=8))
        assert runner.lora is not None and len(runner.lora.slots.layers) == 7 * loaded.model.config.num_hidden_layers
        for slot, (name, folder) in enumerate(adapter_folders.items()):
            runner.lora.slots.place(slot, read_adapter(name, folder, runner.model, max_rank=8))
        runners.append(runner)
    eager, compiled = runners
    assert compiled.forward.is_compiled and not eager.forward.is_compiled
    text = byte_prompt(40)
    steps = [[(0, text[:20])], [(BASE_SLOT, text[:17])], [(1, text[:9]), (BASE_SLOT, text[:13]), (0, text[:11])]]
    for index, step in enumerate(steps):
        sequences = [ScheduledSequence(f"s{index}-{n}", tokens, 0, (4 * n, 4 * n + 1), True, SamplingParams(),
                                       lora_slot=slot) for n, (slot, tokens) in enumerate(step)]
        expected, got = eager.compute_logits(sequences), compiled.compute_logits(sequences)
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=0)
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    assert compiled.forward.num_graphs == 1 and compiled.forward.recompilations == 0


def test_an_adapter_on_fused_projections_computes_what_peft_computes() -> None:
    """Phi-3 fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`: an adapter on them is served."""
    peft_model = get_peft_model(build_model("phi3"), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)) * 0.2)
    with tempfile.TemporaryDirectory() as folder:
        peft_model.save_pretrained(folder)
        model = build_model("phi3")
        slots = LoraSlots(model, num_slots=1, max_rank=8)
        slots.place(0, read_adapter("fused", Path(folder), model, max_rank=8))
    text = [5, 17, 33, 2, 9, 40, 41, 42]
    slots.select(torch.zeros(len(text), dtype=torch.long))
    expected = logits_of(peft_model.eval(), text)
    torch.testing.assert_close(logits_of(model, text), expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(expected, logits_of(build_model("phi3"), text), atol=1e-3)
    assert {name.rsplit(".", 1)[-1] for name in slots.layers} >= {"qkv_proj", "gate_up_proj"}
