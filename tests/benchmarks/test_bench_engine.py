"""`fairlane bench engine` end to end on builtin:tiny with a handful of short requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.process.cli import build_parser
from benchmarks.bench_engine import EngineBenchOptions, options_from_args
from benchmarks.cli import add_bench_command, main
from benchmarks.common import WorkloadSpec, make_workload
from tests.isolation import in_fresh_process

SYSTEMS = ("fairlane", "hf_static", "hf_continuous")
PEERS = ("hf_static", "hf_continuous")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "engine.json"
    code = main(["bench", "engine", "--model", "builtin:tiny", "--requests", "4", "--seed", "3",
                 "--prompt-len", "8:24", "--output-len", "4:12", "--static-batch-size", "2",
                 "--kv-cache-bytes", str(4 * 1024 * 1024), "--kv-cache-dtype", "float32", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "64", "--hf-compile", "eager", "--in-process", "--out", str(out)])
    assert code == 0
    data: dict[str, Any] = json.loads(Path(out).read_text())
    return data


def test_every_system_generates_exactly_the_requested_tokens(report: dict[str, Any]) -> None:
    expected = sum(r.num_output_tokens for r in make_workload(WorkloadSpec(4, 3, (8, 24), (4, 12))))
    assert report["workload"]["output_tokens"] == expected
    assert set(report["systems"]) == set(SYSTEMS)
    for name in SYSTEMS:
        system = report["systems"][name]
        assert system["num_output_tokens"] == expected, name
        assert system["wall_seconds"] > 0, name
        assert system["tokens_per_s"] == pytest.approx(expected / system["wall_seconds"]), name
        assert system["peak_rss_mib"] > 0, name


def test_report_has_ratios_forward_fraction_and_memory(report: dict[str, Any]) -> None:
    ours = report["systems"]["fairlane"]["tokens_per_s"]
    for peer in PEERS:
        assert report["ratios"][f"vs_{peer}"] == pytest.approx(ours / report["systems"][peer]["tokens_per_s"])
    assert 0 < report["forward_fraction"] <= 1
    assert report["peak_rss_mib"] >= max(s["peak_rss_mib"] for s in report["systems"].values())


def test_greedy_outputs_agree_across_systems(report: dict[str, Any]) -> None:
    """Same weights, greedy, no EOS: all three systems produce the same tokens."""
    assert report["greedy_match"] == {"hf_static": 1.0, "hf_continuous": 1.0}
    assert report["greedy_common_prefix"] == {"hf_static": 1.0, "hf_continuous": 1.0}


def test_the_workload_is_fixed_by_its_seed() -> None:
    spec = WorkloadSpec(16, 0)
    first, again = make_workload(spec), make_workload(spec)
    assert first == again
    assert all(16 <= len(r.prompt_token_ids) <= 256 and 16 <= r.num_output_tokens <= 256 for r in first)
    assert make_workload(WorkloadSpec(16, 1)) != first


def test_an_unknown_system_is_refused_before_anything_runs() -> None:
    with pytest.raises(SystemExit, match="unknown systems"):
        main(["bench", "engine", "--model", "builtin:tiny", "--systems", "fairlane,vllm", "--in-process"])


def options_of(*flags: str) -> EngineBenchOptions:
    return options_from_args(build_parser((add_bench_command,)).parse_args(["bench", "engine", *flags]))


def test_hf_compile_same_gives_the_baselines_the_engines_mode() -> None:
    assert options_of("--compile", "default").hf_compile == "default"
    assert options_of("--compile", "max", "--hf-compile", "same").hf_compile == "max"
    assert options_of("--compile", "max", "--hf-compile", "eager").hf_compile == "eager"


@pytest.mark.slow
@in_fresh_process  # the baselines compile in this process: what dynamo keeps stays out of later tests
def test_compiled_baselines_run_through_inductor_and_still_agree(tmp_path: Path) -> None:
    """With `--hf-compile default` both baselines compile through inductor, and their greedy tokens still equal the
    (eager) engine's. The systems share one process, so dynamo's count of graphs runs on from one to the next:
    hf_static's is its own, and hf_continuous compiled graphs of its own when its count is higher."""
    out = tmp_path / "engine.json"
    code = main(["bench", "engine", "--model", "builtin:tiny", "--requests", "2", "--seed", "3",
                 "--prompt-len", "8:16", "--output-len", "4:8", "--static-batch-size", "2",
                 "--kv-cache-bytes", str(4 * 1024 * 1024), "--kv-cache-dtype", "float32", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "64", "--compile", "eager", "--hf-compile", "default", "--in-process",
                 "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["config"]["hf_compile"] == "default"
    for peer in PEERS:
        assert report["systems"][peer]["compile"] == "default", peer
    num_static, num_continuous = (report["systems"][peer]["compiled_graphs"] for peer in PEERS)
    assert 1 <= num_static < num_continuous
    assert report["greedy_match"] == {"hf_static": 1.0, "hf_continuous": 1.0}
