"""Defaults that follow the machine: the KV pool from free memory, bfloat16 where the CPU computes it natively."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from gpu.models import (
    LoadedModel,
    cpu_has_native_bfloat16,
    cpu_multiplies_bfloat16,
    cpu_multiplies_int8,
    resolve_dtype,
)
from gpu.runner import ModelRunner, RunnerBudget, kv_pool_bytes, kv_shape_of

CPU = torch.device("cpu")


def budget(**overrides: object) -> RunnerBudget:
    values: dict[str, object] = {"block_size": 16, "kv_cache_bytes": None, "swap_space_bytes": 0}
    return RunnerBudget(**{**values, **overrides})  # type: ignore[arg-type]


def test_a_given_byte_budget_is_kept() -> None:
    assert kv_pool_bytes(budget(kv_cache_bytes=12345), 1024, 4096, CPU) == 12345


def test_the_automatic_pool_is_a_share_of_free_memory() -> None:
    before = psutil.virtual_memory().available
    got = kv_pool_bytes(budget(kv_cache_memory_fraction=0.01, max_num_seqs=10**6), 1024, 4096, CPU)
    after = psutil.virtual_memory().available
    assert 0.01 * min(before, after) * 0.9 <= got <= 0.01 * max(before, after) * 1.1


def test_the_automatic_pool_holds_no_more_than_max_num_seqs_full_sequences() -> None:
    got = kv_pool_bytes(budget(kv_cache_memory_fraction=0.5, max_num_seqs=3), 1000, 100, CPU)
    assert got == 3 * 7 * 1000  # 100 tokens take 7 blocks of 16


def test_a_runner_without_a_byte_budget_sizes_its_pool(tiny_model: LoadedModel, caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    caplog.set_level("INFO", logger="gpu.runner")
    runner = ModelRunner(tiny_model, budget(max_num_seqs=2, max_model_len=256))
    assert runner.geometry.num_device_blocks == 2 * 256 // 16
    assert runner.geometry.bytes_per_block == kv_shape_of(tiny_model, 16).bytes_per_block
    assert "512 tokens in all" in caplog.text


AMX_BF16 = "fpu sse avx2 avx512f amx_bf16 amx_tile"
AVX512_BF16 = "fpu sse avx2 avx512f avx512_bf16"
AVX512 = "fpu sse avx2 avx512f"


@pytest.mark.parametrize(("reader", "flags", "found"), [
    # a whole model in bfloat16: only with AMX
    (cpu_has_native_bfloat16, AMX_BF16, True),
    (cpu_has_native_bfloat16, AVX512_BF16, False),
    (cpu_has_native_bfloat16, AVX512, False),
    # bfloat16 dense copies: with bfloat16 dot products
    (cpu_multiplies_bfloat16, AMX_BF16, True),
    (cpu_multiplies_bfloat16, AVX512_BF16, True),
    (cpu_multiplies_bfloat16, AVX512, False),
    # int8 copies on `_int_mm`: with int8 dot products
    (cpu_multiplies_int8, "fpu sse avx2 avx512f avx512_vnni", True),
    (cpu_multiplies_int8, "fpu sse avx2 avx_vnni", True),
    (cpu_multiplies_int8, "fpu sse avx2 amx_int8 amx_tile", True),
    (cpu_multiplies_int8, "fpu sse avx2 fma", False),
])
def test_what_the_cpu_multiplies_fast_is_read_from_its_flags(tmp_path: Path, reader: Callable[[str], bool],
                                                              flags: str, found: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n")
    assert reader(str(cpuinfo)) is found


def test_without_cpuinfo_there_is_no_native_bfloat16(tmp_path: Path) -> None:
    assert not cpu_has_native_bfloat16(str(tmp_path / "missing"))
    assert not cpu_multiplies_bfloat16(str(tmp_path / "missing"))
    assert not cpu_multiplies_int8(str(tmp_path / "missing"))


def test_explicit_dtypes_win_over_the_machine() -> None:
    assert resolve_dtype("float32", CPU) is torch.float32
    assert resolve_dtype("bfloat16", CPU) is torch.bfloat16
    assert resolve_dtype("auto", CPU) is (torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32)
