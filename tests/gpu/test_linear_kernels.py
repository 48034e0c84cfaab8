"""The kernel per step shape: a packed layer's dense copy holds the values the packed kernel multiplies by
(an int8 copy, smoothed, within a few percent of them) and runs from its row count on, the plan takes a
dense dtype only where it wins from some row count on, it is measured once per machine, a compiled forward
runs large steps through a second graph that takes the copies, and a quantized model with dense copies
serves through the engine."""

from __future__ import annotations

import asyncio
import copy
import gc
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from contract.plan import SamplingParams, ScheduledSequence
from gpu import calibration, linear_kernels
from gpu.compiled import PackedForward, compilations_so_far, use_artifact_folder, warm_up_steps
from gpu.linear_kernels import ROW_BUCKETS, KernelPlan, dense_copy_bytes, measure_plan, plan_linear_kernels
from gpu.models import LoadedModel, build_builtin, load_model
from gpu.quantization import (
    _FBGEMM_WEIGHTS,
    INT8_PRECISIONS,
    DenseCopy,
    FbgemmWeight,
    Int4WeightOnlyLinear,
    Int8Gemm,
    Int8WeightOnlyLinear,
    PackedLinear,
    fbgemm_available,
    fbgemm_dynamic_linear,
    head_layer_name,
    int4_groups,
    int8_dynamic_linear,
    int8_per_row,
    layer_modes,
    quantize_linears,
)
from gpu.tokenizer import ByteTokenizer
from tests.factories import assert_kv_all_free, collect, make_engine, make_request, make_runner, running, tokens_of
from tests.gpu.reference import byte_prompt, hf_logits

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="this torch has no fbgemm kernels")


def packed_pair(kind: type[PackedLinear]) -> tuple[nn.Module, nn.Module]:
    """The same layer packed twice: without a dense copy, and with one from 4 rows on."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=True)
    if kind is Int4WeightOnlyLinear:
        return Int4WeightOnlyLinear(linear), Int4WeightOnlyLinear(linear, dense=DenseCopy(torch.float32, 4))
    return Int8WeightOnlyLinear(linear), Int8WeightOnlyLinear(linear, DenseCopy(torch.float32, 4))


@pytest.mark.parametrize("kind", [Int4WeightOnlyLinear, Int8WeightOnlyLinear])
def test_the_dense_copy_multiplies_the_packed_values_from_its_row_count(kind: type[PackedLinear]) -> None:
    packed, with_copy = packed_pair(kind)
    assert packed.dense_weight is None and with_copy.dense_weight is not None
    few, many = torch.randn(3, 128), torch.randn(2, 2, 128)  # 3 rows, then 4
    with torch.inference_mode():
        assert torch.equal(with_copy(few), packed(few))  # below the row count: the packed kernel itself
        dense = nn.functional.linear(many, with_copy.dense_weight, with_copy.bias)
        assert torch.equal(with_copy(many), dense)
        # The same weights: what is left is the packed kernel's bfloat16 activations.
        relative = (with_copy(many) - packed(many)).norm() / packed(many).norm()
    assert relative < 1e-2, float(relative)


def test_an_int4_dense_copy_is_the_groups_integers_times_their_scales() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(64, 64, bias=False)
    q, scales, minimums = int4_groups(linear.weight.detach())
    expected = (q.float().reshape(64, 2, 32) * scales[..., None] + minimums[..., None]).reshape(64, 64)
    layer = Int4WeightOnlyLinear(linear, dense=DenseCopy(torch.float32, 1))
    assert layer.dense_weight is not None
    # The kernel's scales and zeros are bfloat16: the copy has the values the kernel computes with.
    torch.testing.assert_close(layer.dense_weight, expected, rtol=0, atol=float(scales.max()) * 2**-7 * 16)


def timer(dense_ms: dict[int, float], packed_ms: float = 10.0) -> linear_kernels.StepTimer:
    return lambda rows, kernel: (dense_ms.get(rows, 2 * packed_ms) if kernel != "packed" else packed_ms) / 1e3


def test_the_plan_takes_the_dense_copy_from_the_first_of_the_buckets_it_wins_in_a_row() -> None:
    plan = measure_plan(timer({64: 7.0, 128: 6.0, 256: 1.0, 512: 1.0}), ["float32"])
    assert (plan.dense_dtype, plan.dense_from_rows) == (torch.float32, 64)
    assert plan.step_linears_ms is not None and max(plan.step_linears_ms) == 128  # it stops once confirmed
    assert plan.takes_dense(64) and plan.takes_dense(500) and not plan.takes_dense(63)


def test_one_bucket_won_alone_is_not_taken_and_never_winning_keeps_the_packed_kernels() -> None:
    noisy = measure_plan(timer({16: 7.0, 256: 7.0, 512: 7.0}), ["float32"])
    assert noisy.dense_from_rows == 256
    never = measure_plan(timer({}), ["float32"])
    assert (never.dense_dtype, never.dense_from_rows) == (None, None)
    assert never.step_linears_ms is not None and sorted(never.step_linears_ms) == list(ROW_BUCKETS)


def test_a_win_within_the_timings_noise_is_no_win() -> None:
    slim = measure_plan(timer({32: 9.5, 64: 9.5, 128: 9.0, 256: 9.0}), ["float32"])
    assert slim.dense_from_rows == 128


def test_the_fastest_dense_dtype_is_the_one_kept() -> None:
    def time_step(rows: int, kernel: str) -> float:
        return {"packed": 10.0, "float32": 8.0, "bfloat16": 4.0}[kernel] / 1e3

    plan = measure_plan(time_step, ["float32", "bfloat16"])
    assert (plan.dense_dtype, plan.dense_from_rows) == (torch.bfloat16, 1)


def test_past_an_int8_win_the_float_copies_are_timed_on_for_the_layers_the_calibration_leaves_packed() -> None:
    """int8 copies win from 8 rows; bfloat16 ones only from 64: those are what a layer int8 leaves packed keeps
    (from 64 rows), timed on past the int8 decision without the int8 kernel. A float winner needs no fallback."""
    def time_step(rows: int, kernel: str) -> float:
        packed = 1.0 * rows
        times = {"packed": packed, "int8": packed * (0.5 if rows >= 8 else 2.0),
                 "bfloat16": packed * (0.8 if rows >= 64 else 1.2)}
        return times[kernel] / 1e3

    plan = measure_plan(time_step, ["bfloat16", "int8"])
    assert plan.dense == DenseCopy(torch.int8, 8) and plan.fallback == DenseCopy(torch.bfloat16, 64)
    assert plan.step_linears_ms is not None and max(plan.step_linears_ms) == 128  # confirmed at 128
    assert all("int8" in row for rows, row in plan.step_linears_ms.items() if rows <= 12)
    assert all(set(row) == {"packed", "bfloat16"} for rows, row in plan.step_linears_ms.items() if rows > 12)
    assert linear_kernels.plan_from_json(json.loads(json.dumps(linear_kernels.plan_as_json(plan)))).fallback == \
        plan.fallback
    assert plan.graph_variant() == "+dense-int8-from8+fallback-bfloat16-from64"
    assert "the layers without one packed below 64 rows, bfloat16 copies from there" in plan.describe()
    floats_win = measure_plan(lambda rows, kernel: (0.5 if kernel == "bfloat16" else 1.0) / 1e3, ["bfloat16"])
    assert floats_win.dense == DenseCopy(torch.bfloat16, 1) and floats_win.fallback is None


@pytest.mark.parametrize("kind", [Int4WeightOnlyLinear, Int8WeightOnlyLinear])
def test_a_layer_int8_leaves_packed_takes_its_float_copy_from_its_own_row_count_eagerly_and_compiled(
        kind: type[PackedLinear]) -> None:
    """No smoothing (the calibration's verdict): no int8 copy, but the fallback's bfloat16 copy, from 16 rows in
    a graph of steps from 8 rows on, chosen when the step runs (one graph); below 16 the packed kernel's result."""
    torch.manual_seed(3)
    linear = nn.Linear(128, 64, bias=True)
    layer = kind(linear, dense=DenseCopy(torch.int8, 8), fallback=DenseCopy(torch.bfloat16, 16))
    packed_only = kind(linear)
    assert layer.dense_weight is not None and layer.dense_weight.dtype == torch.bfloat16
    assert layer.dense_input_scales is None and (layer.dense_from_rows, layer.fallback_from_rows) == (8, 16)

    def large_step(x: torch.Tensor) -> torch.Tensor:  # as the large steps' graph: told the rows reach 8
        torch._check(x.shape[0] >= 8)  # type: ignore[no-untyped-call]
        out: torch.Tensor = layer(x)
        return out

    torch._dynamo.reset()
    before = compilations_so_far()
    compiled = torch.compile(large_step, fullgraph=True)
    for rows in (9, 20, 15, 16):
        x = torch.randn(rows, 128)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        with torch.inference_mode():
            out, eager, packed = compiled(x), layer(x), packed_only(x)
            copy_ = nn.functional.linear(x.bfloat16(), layer.dense_weight).float() + linear.bias
        torch.testing.assert_close(out, eager)
        assert torch.equal(eager, packed) == (rows < 16)
        if rows >= 16:
            torch.testing.assert_close(eager, copy_)
        torch.testing.assert_close(out, packed, atol=0.05, rtol=0.02)  # the same values, in bfloat16
    assert compilations_so_far() - before == 1


def test_only_the_layers_without_smoothing_keep_the_fallback_copy() -> None:
    model = build_builtin("tiny", seed=0)
    head = head_layer_name(model)
    names = [name for name in layer_modes(model, "int4") if name != head]  # the packed layers, the head apart
    assert len(names) >= 2
    calibrated = {name: torch.ones(model.get_submodule(name).in_features) for name in names[::2]}
    quantize_linears(model, "int4", DenseCopy(torch.int8, 8), calibrated, fallback=DenseCopy(torch.bfloat16, 64))
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, PackedLinear) and layer.dense_weight is not None
        expected = (torch.int8, 0) if name in calibrated else (torch.bfloat16, 64)
        assert (layer.dense_weight.dtype, layer.fallback_from_rows) == expected


def test_the_plan_is_measured_once_per_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_builtin("tiny", seed=0)
    calls: list[int] = []

    def measure(time_step: linear_kernels.StepTimer, candidates: list[str]) -> KernelPlan:
        calls.append(1)
        return KernelPlan(DenseCopy(torch.float32, 32), {1: {"packed": 1.0, "float32": 2.0}})

    monkeypatch.setattr(linear_kernels, "measure_plan", measure)
    plans = [plan_linear_kernels(model, "int8", torch.float32, torch.device("cpu"), native_bfloat16=False,
                                 cache_dir=tmp_path) for _ in range(2)]
    timings = {1: {"packed": 1.0, "float32": 2.0}}
    measured = KernelPlan(DenseCopy(torch.float32, 32), timings, DenseCopy(torch.float32, 32), timings)
    assert calls == [1, 1] and plans[0] == plans[1] == measured  # the layers, then the LM head apart
    assert measured.graph_variant() == "+dense-float32-from32+head-float32-from32"  # the artifacts' folder
    [kept] = tmp_path.glob("linear-kernels-*.json")
    assert json.loads(kept.read_text())["dense_from_rows"] == json.loads(kept.read_text())["head_from_rows"] == 32
    packed = plan_linear_kernels(model, "int8", torch.float32, torch.device("cpu"), native_bfloat16=False,
                                 choice="packed", cache_dir=tmp_path)
    unquantized = plan_linear_kernels(model, "none", torch.float32, torch.device("cpu"), native_bfloat16=False,
                                      cache_dir=tmp_path)
    assert packed == unquantized == KernelPlan() and calls == [1, 1] and packed.graph_variant() == ""


def test_a_measurement_whose_timings_fall_as_rows_grow_is_taken_again_and_kept_only_once_consistent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As measured beside a compiler's build: the packed kernels read 1,028 ms at 8 rows and 616 ms at 12."""
    busy = {8: {"packed": 1027.5, "float32": 188.5}, 12: {"packed": 615.6, "float32": 2445.6}}
    quiet = {8: {"packed": 72.6, "float32": 96.5}, 12: {"packed": 100.1, "float32": 112.3}}
    measurements = iter([busy, busy, quiet, quiet])  # each attempt: the layers, then the LM head

    def measure(time_step: linear_kernels.StepTimer, candidates: list[str]) -> KernelPlan:
        return KernelPlan(None, next(measurements))

    def plan(cache_dir: Path) -> KernelPlan:
        return plan_linear_kernels(build_builtin("tiny", seed=0), "int8", torch.float32, torch.device("cpu"),
                                   native_bfloat16=False, cache_dir=cache_dir)

    monkeypatch.setattr(linear_kernels, "measure_plan", measure)
    assert linear_kernels.falling_timings(KernelPlan(None, busy)) == [
        "layers, packed: 8 rows 1027.5 ms, 12 rows 615.6 ms"]
    assert plan(tmp_path).step_linears_ms == quiet  # measured again, and kept
    assert len(list(tmp_path.glob("linear-kernels-*.json"))) == 1
    # Busy at every attempt: the plan serves this start, and nothing is kept for the next.
    measurements = iter([busy, quiet] * linear_kernels.MEASURING_ATTEMPTS)
    assert plan(tmp_path / "busy").step_linears_ms == busy and not (tmp_path / "busy").exists()
    assert next(measurements, None) is None  # every attempt measured
    # A small model's timings wobble by microseconds: no fall.
    assert linear_kernels.falling_timings(KernelPlan(None, {1: {"packed": 0.3}, 4: {"packed": 0.1}})) == []


def test_a_timing_cycles_through_copies_of_the_layer_past_the_cache_as_a_step_reads_its_weights() -> None:
    layer = linear_kernels.DenseMultiply(nn.Linear(1024, 1024, bias=False), torch.float32)  # 4 MiB
    assert linear_kernels.num_copies(layer, count=1000) == linear_kernels.COLD_BYTES // (4 * 2**20)
    assert linear_kernels.num_copies(layer, count=3) == 3  # never more than the model has
    calls: list[int] = []

    class Recording(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(id(self))
            return x

    multiply = linear_kernels.cold_multiply(Recording(), count=3)
    for _ in range(5):
        multiply(torch.zeros(1))
    assert len(set(calls[:3])) == 3 and calls[3:] == calls[:2]  # a copy per call, in turn


def test_a_real_measurement_times_every_kernel_up_to_its_decision(tmp_path: Path) -> None:
    plan = plan_linear_kernels(build_builtin("tiny", seed=0), "int8", torch.float32, torch.device("cpu"),
                               native_bfloat16=False, cache_dir=tmp_path)
    assert plan.step_linears_ms is not None
    kernels = {"packed", "float32", "int8"}  # int8 copies on a CPU (on fbgemm only under auto-fbgemm)
    # Past an int8 win, only the float copies go on (for the layers the calibration leaves packed).
    assert all({"packed", "float32"} <= set(row) <= kernels and min(row.values()) > 0
               for row in plan.step_linears_ms.values())
    assert set(plan.step_linears_ms[ROW_BUCKETS[0]]) == kernels
    if plan.dense_from_rows is None:  # no dense win: every bucket was timed
        assert plan.dense_dtype is None and sorted(plan.step_linears_ms) == list(ROW_BUCKETS)
    # The LM head is planned apart, on float copies only: an int8 copy's activations would round the logits.
    assert plan.head_ms is not None
    assert all(set(row) == {"packed", "float32"} and min(row.values()) > 0 for row in plan.head_ms.values())
    model = build_builtin("tiny", seed=0)
    assert linear_kernels.head_layout(model, "int4") == (model.config.hidden_size, model.config.vocab_size, "int8")
    assert sum(linear_kernels.packed_layouts(model, "int4").values()) == len(layer_modes(model, "int4")) - 1


def test_the_lm_head_keeps_its_own_copy_and_the_other_layers_theirs() -> None:
    model = build_builtin("tiny", seed=0)
    quantize_linears(model, "int4", DenseCopy(torch.float32, 16), head=DenseCopy(torch.bfloat16, 4))
    head = model.get_output_embeddings()
    assert isinstance(head, Int8WeightOnlyLinear) and head.switches_at_run_time
    assert head.dense_weight is not None and head.dense_weight.dtype == torch.bfloat16 and head.dense_from_rows == 4
    others = [m for m in model.modules() if isinstance(m, PackedLinear) and m is not head]
    assert others and all(m.dense_from_rows == 16 and not m.switches_at_run_time for m in others)


def test_the_lm_head_chooses_its_copy_by_the_rows_it_keeps_inside_a_compiled_graph() -> None:
    """A compiled graph cannot know an LM head's kept rows against its copy's row count: the head chooses
    when the step runs, in both directions within one graph, as the eager head does."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 256, bias=False)
    head = Int8WeightOnlyLinear(linear, DenseCopy(torch.bfloat16, 8))
    head.switches_at_run_time = True
    packed_only = Int8WeightOnlyLinear(linear)
    torch._dynamo.reset()
    before = compilations_so_far()
    compiled = torch.compile(lambda x: head(x), fullgraph=True)
    for rows in (3, 20, 1, 9):
        x = torch.randn(rows, 64)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        with torch.inference_mode():
            out, eager, packed = compiled(x), head(x), packed_only(x)
        torch.testing.assert_close(out, eager)
        # Below the row count the packed kernel's result exactly; from it, the copy's (bfloat16 rounding apart).
        assert torch.equal(out, packed) == (rows < 8)
        torch.testing.assert_close(out, packed, atol=0.05, rtol=0.02)
    assert compilations_so_far() - before == 1  # one graph served every row count


def model_with_copies(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, from_rows: int,
                      gemm: Int8Gemm = "int_mm") -> LoadedModel:
    """builtin:tiny in int8 with a dense copy of every packed layer (int8: every layer but the head, the
    error bound lifted: the random model's errors are not a real model's)."""
    copy_ = DenseCopy(dtype, from_rows, gemm)
    monkeypatch.setattr(linear_kernels, "measure_plan", lambda *_: KernelPlan(copy_))
    monkeypatch.setattr(calibration, "INT8_MAX_ERROR", 1.0)
    return load_model("builtin:tiny", device="cpu", dtype="float32", quantization="int8", linear_kernels="auto")


@pytest.mark.slow  # compiles two graphs
def test_a_compiled_forward_runs_steps_from_the_dense_row_count_through_a_graph_that_takes_the_copies(
        monkeypatch: pytest.MonkeyPatch, compile_artifacts: Path) -> None:
    """Two graphs: steps below the row count on the packed kernels, steps from it on the (int8) copies, each
    as the eager forward computes them, and neither compiles again for another step size."""
    loaded = model_with_copies(monkeypatch, torch.int8, from_rows=4)
    runner = make_runner(loaded, num_blocks=8)
    use_artifact_folder(compile_artifacts)
    torch._dynamo.reset()  # its own graphs, not those an earlier test compiled for another model's layers
    forward = PackedForward(runner.model, "default", dense_from_rows=4)
    assert forward.has_large_graph
    steps = {"prompt": [ScheduledSequence("a", [5, 6, 7, 8, 9], 0, (0,), True, SamplingParams())],
             "short": [ScheduledSequence("c", [5, 6], 0, (2,), True, SamplingParams())],
             "longer": [ScheduledSequence("b", list(range(10, 21)), 0, (1,), True, SamplingParams())]}
    before = compilations_so_far()
    compiled = {name: runner._logits(step, (), runner.cache, forward) for name, step in steps.items()}
    assert compilations_so_far() - before == 2  # one graph per side of the row count
    eager = {name: runner.compute_logits(step) for name, step in steps.items()}
    for module in runner.model.modules():
        if isinstance(module, PackedLinear):
            module.dense_from_rows = 10**9
    packed_only = runner.compute_logits(steps["prompt"])
    for name in steps:  # int8: an activation may round the other way
        torch.testing.assert_close(compiled[name], eager[name], rtol=2e-2, atol=2e-2)
    # The large graph multiplied the copies, not the packed kernels: far closer to the former.
    assert (compiled["prompt"] - eager["prompt"]).abs().max() < (packed_only - eager["prompt"]).abs().max() / 4


def test_warm_up_runs_a_step_for_each_graph() -> None:
    steps = warm_up_steps(16, 32, large_rows=40)
    assert sum(len(s.token_ids) for s in steps[-1][1]) == 40
    assert len(warm_up_steps(16, 32)) == len(steps) - 1


@pytest.mark.parametrize("gemm", ["int_mm", pytest.param("fbgemm", marks=needs_fbgemm)])
@pytest.mark.parametrize("kind", [Int4WeightOnlyLinear, Int8WeightOnlyLinear])
def test_an_int8_copy_multiplies_within_a_few_percent_of_the_packed_kernel(kind: type[PackedLinear],
                                                                            gemm: Int8Gemm) -> None:
    torch.manual_seed(2)
    linear = nn.Linear(128, 64, bias=True)
    x = torch.randn(6, 128)
    x[:, 7] *= 40  # one large input channel, as a real layer has: the smoothing keeps it from the others' bits
    copy_ = DenseCopy(torch.int8, 4, gemm)
    smoothing = calibration.smoothing_factors(x, linear.weight.detach(), copy_.int8_precision.smoothing_alpha)
    packed = kind(linear)
    with_copy = kind(linear, dense=copy_, smoothing=smoothing)
    unsmoothed = kind(linear, dense=copy_, smoothing=torch.ones(128))
    assert (with_copy.fbgemm_weight is not None) == (gemm == "fbgemm")
    assert with_copy.has_dense_copy and with_copy.dense_input_scales is not None
    if gemm == "fbgemm":  # its values are kept once, packed
        assert with_copy.dense_weight is None and with_copy.dense_scales is None
    else:
        assert with_copy.dense_weight is not None and with_copy.dense_weight.dtype == torch.int8
    with torch.inference_mode():
        assert torch.equal(with_copy(x[:3]), packed(x[:3]))  # below the row count: the packed kernel
        error = (with_copy(x) - packed(x)).norm() / packed(x).norm()
        unsmoothed_error = (unsmoothed(x) - packed(x)).norm() / packed(x).norm()
    assert error < 0.03 and error < unsmoothed_error, (float(error), float(unsmoothed_error))


@needs_fbgemm
def test_an_fbgemm_copy_multiplies_as_the_calibration_reckons_it_eagerly_and_compiled() -> None:
    """fbgemm's product is the one the calibration measured a layer's error on (7-bit activations, the
    weight's 8 bits): a compiled graph calls it as an extern op by the packed weight's handle, and gives
    what the eager layer does at every row count, from one graph."""
    torch.manual_seed(3)
    linear = nn.Linear(96, 80, bias=False)
    smoothing = torch.rand(96) + 0.5
    layer = Int4WeightOnlyLinear(linear, dense=DenseCopy(torch.int8, 1, "fbgemm"), smoothing=smoothing)
    assert layer.fbgemm_weight is not None and layer.dense_weight is None
    values, scales = layer.fbgemm_weight.unpacked()
    precision = INT8_PRECISIONS["fbgemm"]
    torch._dynamo.reset()
    before = compilations_so_far()
    def large_step(x: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[0] >= 1)  # type: ignore[no-untyped-call]  # as the runner's large steps' graph does
        return layer(x)  # type: ignore[no-any-return]

    compiled = torch.compile(large_step, fullgraph=True)
    for rows in (1, 7, 33):
        x = torch.randn(rows, 96)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        reckoned = int8_dynamic_linear(x * (1 / smoothing), values.t().contiguous(), scales,
                                       precision.activation_levels)
        with torch.inference_mode():
            eager, out = layer(x), compiled(x)
        torch.testing.assert_close(eager, reckoned, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    assert compilations_so_far() - before == 1


@needs_fbgemm
def test_an_fbgemm_weight_is_packed_once_per_copy_and_dropped_with_it() -> None:
    values, scales = int8_per_row(torch.randn(16, 32))
    weight = FbgemmWeight(values, scales)
    unpacked_values, unpacked_scales = weight.unpacked()
    assert torch.equal(unpacked_values, values)
    torch.testing.assert_close(unpacked_scales, scales)
    copied = copy.deepcopy(weight)
    assert copied.handle != weight.handle and set(_FBGEMM_WEIGHTS) >= {weight.handle, copied.handle}
    x = torch.randn(3, 32)
    torch.testing.assert_close(fbgemm_dynamic_linear(x, copied), fbgemm_dynamic_linear(x, weight))
    handle = copied.handle
    del copied
    gc.collect()
    assert handle not in _FBGEMM_WEIGHTS and weight.handle in _FBGEMM_WEIGHTS


@needs_fbgemm
def test_auto_fbgemm_times_the_fbgemm_copies_beside_the_others(tmp_path: Path) -> None:
    plan = plan_linear_kernels(build_builtin("tiny", seed=0), "int4", torch.float32, torch.device("cpu"),
                               native_bfloat16=False, choice="auto-fbgemm", cache_dir=tmp_path)
    assert plan.step_linears_ms is not None
    # Every bucket up to the dense decision; past an int8 win only the float copies go on (`KernelPlan.fallback`).
    timed = [rows for rows, row in plan.step_linears_ms.items() if linear_kernels.FBGEMM_KERNEL in row]
    assert timed == list(ROW_BUCKETS[:len(timed)]) and len(timed) >= 2


def test_an_fbgemm_plan_names_its_gemm_on_disk_and_in_its_graphs() -> None:
    plan = KernelPlan(linear_kernels.dense_copy_of(linear_kernels.FBGEMM_KERNEL, 4))
    assert plan.dense == DenseCopy(torch.int8, 4, "fbgemm")
    assert linear_kernels.plan_from_json(linear_kernels.plan_as_json(plan)).dense == plan.dense
    assert plan.graph_variant() == "+dense-int8_fbgemm-from4"  # not the artifacts of an int8 copy on `_int_mm`
    assert KernelPlan(DenseCopy(torch.int8, 4)).graph_variant() == "+dense-int8-from4"
    asked = linear_kernels.dense_candidates(torch.float32, False, torch.device("cpu"), fbgemm=True)
    assert (linear_kernels.FBGEMM_KERNEL in asked) == fbgemm_available()
    assert linear_kernels.FBGEMM_KERNEL not in linear_kernels.dense_candidates(torch.float32, False,
                                                                                torch.device("cpu"))
    assert linear_kernels.FBGEMM_KERNEL not in linear_kernels.dense_candidates(torch.float32, True,
                                                                                torch.device("cuda"))


def test_an_int8_copy_is_kept_only_with_its_smoothing() -> None:
    layer = Int4WeightOnlyLinear(nn.Linear(64, 64, bias=False), dense=DenseCopy(torch.int8, 4))
    assert layer.dense_weight is None and not layer.takes_dense(torch.zeros(8, 64))


def test_calibration_smooths_the_layers_int8_keeps_close_and_never_the_head() -> None:
    model = build_builtin("tiny", seed=0)
    smoothing = calibration.calibrate_int8_copies(model, "int8", ByteTokenizer())
    head = model.get_output_embeddings()
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]
    assert smoothing and set(smoothing) <= set(names)
    for name, factors in smoothing.items():
        assert factors.shape == (model.get_submodule(name).in_features,) and bool((factors > 0).all())


def test_a_layer_past_the_error_bound_keeps_no_int8_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration, "INT8_MAX_ERROR", 0.0)
    assert calibration.calibrate_int8_copies(build_builtin("tiny", seed=0), "int8", ByteTokenizer()) == {}
    # No layer with a copy: the plan keeps none (nor float copies in their place), so no runner compiles a
    # large steps' graph for nothing.
    plan = KernelPlan(DenseCopy(torch.int8, 4), fallback=DenseCopy(torch.bfloat16, 16))
    monkeypatch.setattr(linear_kernels, "measure_plan", lambda *_: plan)
    loaded = load_model("builtin:tiny", device="cpu", dtype="float32", quantization="int8", linear_kernels="auto")
    assert loaded.kernel_plan.dense is None and loaded.kernel_plan.fallback is None
    assert all(m.dense_weight is None for m in loaded.model.modules() if isinstance(m, PackedLinear))


@pytest.mark.parametrize(("dtype", "gemm"), [(torch.float32, "int_mm"), (torch.int8, "int_mm"),
                                             pytest.param(torch.int8, "fbgemm", marks=needs_fbgemm)])
async def test_a_quantized_model_with_dense_copies_serves_its_prompts(monkeypatch: pytest.MonkeyPatch,
                                                                     dtype: torch.dtype, gemm: Int8Gemm) -> None:
    loaded = model_with_copies(monkeypatch, dtype, from_rows=8, gemm=gemm)
    head = loaded.model.get_output_embeddings()
    copies = [m for m in loaded.model.modules()
              if isinstance(m, PackedLinear) and (m is not head or dtype != torch.int8)]  # int8: never the head
    assert copies and all(m.has_dense_copy and m.dense_from_rows == 8 for m in copies)
    assert dense_copy_bytes(loaded.model) > 0
    assert all((m.fbgemm_weight is not None) == (gemm == "fbgemm") for m in copies if m is not head)
    assert loaded.kernel_plan.dense_from_rows == 8
    prompts = [byte_prompt(20 + 15 * i, offset=11 * i) for i in range(4)]
    last_logits = [hf_logits(loaded.model, p)[-1] for p in prompts]  # dense: every prompt is >= 8
    engine = make_engine(loaded, num_blocks=64, block_size=16)
    async with running(engine):
        results = await asyncio.gather(*(collect(engine.submit(make_request(p, 12))) for p in prompts))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    # The engine's LM head sees one row per prompt, under the copies' row count: the packed int8 head, whose
    # rounding can split the random model's near ties (two logits 0.01 apart), where the reference's rows took
    # the copy. So each first token is the reference's pick up to that rounding.
    firsts = [tokens_of(events)[0] for events in results]
    assert all(float(logits.max() - logits[token]) < 0.05 for logits, token in zip(last_logits, firsts, strict=True))
    assert sum(token == int(logits.argmax()) for logits, token in zip(last_logits, firsts, strict=True)) >= 3
    assert all(len(tokens_of(events)) == 12 for events in results)


def test_int8_copies_on_int_mm_are_timed_only_where_the_cpu_has_int8_dot_products() -> None:
    cpu = torch.device("cpu")
    assert "int8" in linear_kernels.dense_candidates(torch.float32, False, cpu, int8_dot_products=True)
    without = linear_kernels.dense_candidates(torch.float32, False, cpu, fbgemm=True, int8_dot_products=False)
    assert "int8" not in without and (linear_kernels.FBGEMM_KERNEL in without) == fbgemm_available()
