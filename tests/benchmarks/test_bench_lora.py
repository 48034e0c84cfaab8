"""`fairlane bench lora` as a smoke test: every mode runs the whole tiny workload and lands in the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_lora import MODES
from benchmarks.cli import main


def test_bench_lora_runs_every_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lora.json"
    assert main(["bench", "lora", "--model", "builtin:tiny", "--device", "cpu", "--compile", "eager",
                 "--kv-cache-bytes", "8000000", "--requests", "4", "--prompt-min", "8", "--prompt-max", "16",
                 "--output-min", "2", "--output-max", "4", "--out", str(out)]) == 0
    modes = json.loads(out.read_text())["modes"]
    assert list(modes) == [mode.name for mode in MODES]
    for name, result in modes.items():
        assert result["requests"] == 4 and result["output_tokens_per_s"] > 0, name
    assert modes["lora16_r64"]["adapters"] == 16 and modes["lora16_r64"]["rank"] == 64
    assert "lora16_r8" in capsys.readouterr().out
