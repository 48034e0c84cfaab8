"""Weight-only quantization: the packed kernels compute what the float layer does, a Q4_1 weight comes
back as its own integers, and a quantized model serves through the engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gpu.models import gguf_digest, gguf_parsed_once, load_model, resolve_quantization, shipped_quantization
from gpu.quantization import (
    INT4_GROUP_SIZE,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    Quantization,
    int4_groups,
)
from tests.factories import assert_kv_all_free, collect, make_engine, make_request, running, tokens_of
from tests.gpu.reference import byte_prompt, hf_logits


def q4_1_weight(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight as GGUF's Q4_1 stores it: per group of 32, w = q * d + m, d and m in float16, and the
    quantizer's own min and max (q = 0 and q = 15) present in every group."""
    generator = torch.Generator().manual_seed(0)
    groups = cols // INT4_GROUP_SIZE
    q = torch.randint(0, 16, (rows, groups, INT4_GROUP_SIZE), generator=generator, dtype=torch.int32)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(rows, groups, generator=generator).mul(0.02).add(1e-3).half().float()
    m = torch.randn(rows, groups, generator=generator).mul(0.1).half().float()
    weight = q.float() * d[..., None] + m[..., None]
    return weight.reshape(rows, cols), q.reshape(rows, cols), d, m


def test_a_q4_1_weight_comes_back_as_its_own_integers() -> None:
    weight, q, d, m = q4_1_weight(128, 256)
    got_q, got_scales, got_minimums = int4_groups(weight)
    assert torch.equal(got_q, q)
    torch.testing.assert_close(got_scales, d, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_minimums, m, rtol=0, atol=0)


@pytest.mark.parametrize(("kind", "tolerance"), [(Int8WeightOnlyLinear, 0.01), (Int4WeightOnlyLinear, 0.12)])
def test_packed_kernels_track_the_float_layer(kind: type[nn.Module], tolerance: float) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(256, 512, bias=True)
    x = torch.randn(3, 5, 256)
    expected = linear(x)
    got = kind(linear)(x)
    assert got.shape == expected.shape
    relative = (got - expected).norm() / expected.norm()
    assert relative < tolerance, float(relative)


def test_int4_reproduces_a_q4_1_layer_up_to_bfloat16_activations() -> None:
    """The Q4_1 integers, scales and minimums are what the kernel multiplies by; what is left is the
    bfloat16 rounding of the activations, scales and zeros the CPU kernel computes in."""
    weight, _, _, _ = q4_1_weight(64, 128)
    linear = nn.Linear(128, 64, bias=False)
    linear.weight.data = weight
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    expected = x @ weight.t()
    relative = (Int4WeightOnlyLinear(linear)(x) - expected).norm() / expected.norm()
    assert relative < 1e-2, float(relative)


# builtin:tiny's MLP is 688 wide, which int4's groups of 32 and rows of 64 do not divide: those keep float.
REPLACED = {"int8": 2 * 7 + 1, "int4": 2 * 4 + 1}  # per layer of two, and the head


# Random weights leave many near-tied logits, so int4 flips about half of the picks here (a broken kernel
# would agree about 1 time in 320); `fairlane bench quality` measures the real model.
@pytest.mark.parametrize(("mode", "min_agreement"), [("int8", 0.9), ("int4", 0.4)])
async def test_a_quantized_model_serves_close_to_float(mode: Quantization, min_agreement: float,
                                                       tiny_reference: Any) -> None:
    loaded = load_model("builtin:tiny", device="cpu", dtype="float32", quantization=mode)
    replaced = [m for m in loaded.model.modules() if isinstance(m, Int8WeightOnlyLinear | Int4WeightOnlyLinear)]
    assert len(replaced) == REPLACED[mode]
    assert isinstance(loaded.model.lm_head, Int8WeightOnlyLinear)  # 8 bits, as GGUF's 4-bit files keep it
    text = byte_prompt(200)
    # Teacher-forced: the next token each would pick at every position of the same text.
    agreement = (hf_logits(loaded.model, text).argmax(-1) == hf_logits(tiny_reference, text).argmax(-1))
    assert float(agreement.float().mean()) >= min_agreement
    prompts = [byte_prompt(20 + 15 * i, offset=11 * i) for i in range(4)]
    expected_first = [int(hf_logits(loaded.model, p)[-1].argmax()) for p in prompts]  # before the paged switch
    engine = make_engine(loaded, num_blocks=64, block_size=16)
    async with running(engine):
        results = await asyncio.gather(*(collect(engine.submit(make_request(p, 16))) for p in prompts))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    first_tokens = [tokens_of(events)[0] for events in results]
    assert all(len(tokens_of(events)) == 16 for events in results)
    assert first_tokens == expected_first


def write_gguf(path: Path, block_type: str, layers: int = 3) -> Path:
    """A GGUF file whose layers' linear weights are stored in one block type (and an F32 norm)."""
    import gguf
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), "llama")
    kind = gguf.GGMLQuantizationType[block_type]
    data = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_q.weight", quantize(data, kind), raw_dtype=kind)
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", data[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("block_type", "expected"), [("Q4_1", "int4"), ("Q4_0", "int4"), ("Q8_0", "int8"),
                                                      ("F16", "none"), ("F32", "none")])
def test_auto_keeps_a_gguf_files_own_precision(tmp_path: Path, block_type: str, expected: str) -> None:
    path = write_gguf(tmp_path / "model.gguf", block_type)
    assert shipped_quantization(path) == expected
    assert resolve_quantization(str(path), "auto") == expected
    assert resolve_quantization(str(path), "none") == "none"  # an explicit choice is kept


def test_the_files_precision_is_kept_beside_its_conversion_and_read_again_only_for_new_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "models"
    path = write_gguf(tmp_path / "model.gguf", "Q4_1")
    assert resolve_quantization(str(path), "auto", cache) == "int4"
    assert [p.suffix for p in cache.iterdir()] == [".quantization"]
    import gguf

    def no_parsing(*_: Any) -> None:
        raise AssertionError("the GGUF file was parsed again")

    with monkeypatch.context() as patched:
        patched.setattr(gguf, "GGUFReader", no_parsing)
        assert resolve_quantization(str(path), "auto", cache) == "int4"  # read from the record
    write_gguf(path, "Q8_0")  # other bytes under the same name: another digest
    assert resolve_quantization(str(path), "auto", cache) == "int8"


def test_a_conversion_parses_its_file_once_and_leaves_gguf_as_it_was(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    import gguf

    file = write_gguf(tmp_path / "model.gguf", "Q4_1")
    path = str(file)
    hashed: list[str] = []
    file_digest = hashlib.file_digest

    def counted(f: Any, name: str) -> Any:
        hashed.append(name)
        return file_digest(f, name)

    monkeypatch.setattr(hashlib, "file_digest", counted)
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        assert gguf.GGUFReader(path) is gguf.GGUFReader(path)  # transformers' three openings share one parse
        llama = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(llama, 3) is gguf.get_tensor_name_map(llama, 3)
        with gguf_parsed_once():  # a block inside another shares the outer one's
            assert gguf.GGUFReader(path) is gguf.GGUFReader(path)
        assert gguf_digest(file) == gguf_digest(file) and len(hashed) == 1  # the precision's record, the conversion
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)
    gguf_digest(file)
    assert len(hashed) == 2  # outside a load, hashed again: the file may have changed


def test_auto_serves_the_default_model_in_its_q4_1_and_builtins_unquantized() -> None:
    assert resolve_quantization("smollm2-135m", "auto") == "int4"  # shipped_quantization of the packaged GGUF
    assert resolve_quantization("builtin:tiny", "auto") == "none"
    assert resolve_quantization("builtin:tiny", "int8") == "int8"
