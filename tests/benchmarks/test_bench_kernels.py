"""`fairlane bench kernels` on builtin:tiny: every kernel timed at every row count, the table and the
JSON agree, and the int8-dynamic kernel (an unsmoothed int8 copy) computes the product it stands for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.bench_kernels import linear_shapes, multiply_of, table
from benchmarks.cli import main
from gpu.models import build_builtin


def test_the_shapes_are_the_models_linear_layers() -> None:
    shapes = linear_shapes(build_builtin("tiny", seed=0))
    # tiny: hidden 256, 4 heads of 64, 2 KV heads, intermediate 688, 2 layers, a vocabulary padded to 320
    assert shapes == {(256, 256): 4, (256, 128): 4, (256, 688): 4, (688, 256): 2, (256, 320): 1}


def test_int8_dynamic_is_the_product_to_int8_precision() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        expected = linear(x)
        made = multiply_of("int8-dynamic", linear)
        assert made is not None
        got = made[0](x)
    assert torch.allclose(got, expected, atol=0.05 * float(expected.abs().max()))


def test_every_kernel_and_row_count_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "kernels.json"
    code = main(["bench", "kernels", "--model", "builtin:tiny", "--rows", "1,8", "--kernels", "float32,int4,int8",
                 "--min-seconds", "0.001", "--out", str(out)])
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out

    assert code == 0
    assert set(report["step_linears_ms"]) == {"1", "8"}
    for row in report["step_linears_ms"].values():
        assert set(row) == {"float32", "int4", "int8"} and all(ms is not None and ms > 0 for ms in row.values())
    assert table(report) in printed and "builtin:tiny" in printed
    assert report["machine"]["cpus"] >= 1
