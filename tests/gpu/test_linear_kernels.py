"""The kernel per step shape: a packed layer's dense copy holds the values the packed kernel multiplies by
and runs from its row count on, the plan takes a dense dtype only where it wins from some row count on,
it is measured once per machine, and a quantized model with dense copies serves through the engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from contract.plan import SamplingParams, ScheduledSequence
from gpu import linear_kernels
from gpu.compiled import PackedForward, compilations_so_far
from gpu.linear_kernels import ROW_BUCKETS, KernelPlan, measure_plan, plan_linear_kernels
from gpu.models import LoadedModel, build_builtin, load_model
from gpu.quantization import DenseCopy, Int4WeightOnlyLinear, Int8WeightOnlyLinear, PackedLinear, int4_groups
from gpu.step_inputs import build_step_inputs
from tests.factories import assert_kv_all_free, collect, make_engine, make_request, make_runner, running, tokens_of
from tests.gpu.reference import byte_prompt, hf_logits


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
    plan = measure_plan(timer({64: 7.0, 128: 6.0, 256: 1.0, 512: 1.0}), [torch.float32])
    assert (plan.dense_dtype, plan.dense_from_rows) == (torch.float32, 64)
    assert plan.step_linears_ms is not None and max(plan.step_linears_ms) == 128  # it stops once confirmed
    assert plan.takes_dense(64) and plan.takes_dense(500) and not plan.takes_dense(63)


def test_one_bucket_won_alone_is_not_taken_and_never_winning_keeps_the_packed_kernels() -> None:
    noisy = measure_plan(timer({16: 7.0, 256: 7.0, 512: 7.0}), [torch.float32])
    assert noisy.dense_from_rows == 256
    never = measure_plan(timer({}), [torch.float32])
    assert (never.dense_dtype, never.dense_from_rows) == (None, None)
    assert never.step_linears_ms is not None and sorted(never.step_linears_ms) == list(ROW_BUCKETS)


def test_a_win_slimmer_than_the_eager_steps_cost_is_no_win() -> None:
    """A step on the dense copies runs eagerly: winning by a few percent over the packed kernels in the
    linears alone loses the step."""
    slim = measure_plan(timer({32: 9.0, 64: 9.0, 128: 7.0, 256: 7.0}), [torch.float32])
    assert slim.dense_from_rows == 128


def test_the_fastest_dense_dtype_is_the_one_kept() -> None:
    def time_step(rows: int, kernel: str) -> float:
        return {"packed": 10.0, "float32": 8.0, "bfloat16": 4.0}[kernel] / 1e3

    plan = measure_plan(time_step, [torch.float32, torch.bfloat16])
    assert (plan.dense_dtype, plan.dense_from_rows) == (torch.bfloat16, 1)


def test_the_plan_is_measured_once_per_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_builtin("tiny", seed=0)
    calls: list[int] = []

    def measure(time_step: linear_kernels.StepTimer, candidates: list[torch.dtype]) -> KernelPlan:
        calls.append(1)
        return KernelPlan(DenseCopy(torch.float32, 32), {1: {"packed": 1.0, "float32": 2.0}})

    monkeypatch.setattr(linear_kernels, "measure_plan", measure)
    plans = [plan_linear_kernels(model, "int8", torch.float32, torch.device("cpu"), native_bfloat16=False,
                                 cache_dir=tmp_path) for _ in range(2)]
    measured = KernelPlan(DenseCopy(torch.float32, 32), {1: {"packed": 1.0, "float32": 2.0}})
    assert calls == [1] and plans[0] == plans[1] == measured
    [kept] = tmp_path.glob("linear-kernels-*.json")
    assert json.loads(kept.read_text())["dense_from_rows"] == 32
    packed = plan_linear_kernels(model, "int8", torch.float32, torch.device("cpu"), native_bfloat16=False,
                                 choice="packed", cache_dir=tmp_path)
    unquantized = plan_linear_kernels(model, "none", torch.float32, torch.device("cpu"), native_bfloat16=False,
                                      cache_dir=tmp_path)
    assert packed == unquantized == KernelPlan() and calls == [1]


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
    assert all(set(row) == {"packed", "float32"} and min(row.values()) > 0 for row in plan.step_linears_ms.values())
    if plan.dense_from_rows is None:  # no dense win: every bucket was timed
        assert plan.dense_dtype is None and sorted(plan.step_linears_ms) == list(ROW_BUCKETS)


def test_a_compiled_forward_sends_steps_from_the_dense_row_count_down_its_eager_path(
        tiny_model: LoadedModel) -> None:
    """Its graph never holds the dense copies: a step that takes them runs eagerly, and compiles nothing."""
    runner = make_runner(tiny_model, num_blocks=8)
    forward = PackedForward(runner.model, "default", dense_from_rows=4)
    prompt = [ScheduledSequence("a", [5, 6, 7, 8, 9], 0, (0,), True, SamplingParams())]
    assert forward.is_compiled
    assert forward.runs_dense(build_step_inputs(prompt, runner.cache))
    before = compilations_so_far()
    logits = runner._logits(prompt, (), runner.cache, forward)
    assert compilations_so_far() == before
    assert torch.equal(logits, runner.compute_logits(prompt))  # the runner's own eager forward


async def test_a_quantized_model_with_dense_copies_serves_its_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_kernels, "measure_plan", lambda *_: KernelPlan(DenseCopy(torch.float32, 8)))
    loaded = load_model("builtin:tiny", device="cpu", dtype="float32", quantization="int8", linear_kernels="auto")
    copies = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert copies and all(m.dense_weight is not None and m.dense_from_rows == 8 for m in copies)
    assert loaded.kernel_plan.dense_from_rows == 8
    prompts = [byte_prompt(20 + 15 * i, offset=11 * i) for i in range(4)]
    expected_first = [int(hf_logits(loaded.model, p)[-1].argmax()) for p in prompts]  # dense: every prompt is >= 8
    engine = make_engine(loaded, num_blocks=64, block_size=16)
    async with running(engine):
        results = await asyncio.gather(*(collect(engine.submit(make_request(p, 12))) for p in prompts))
        assert await engine.wait_idle(timeout=10)
        assert_kv_all_free(engine)
    assert [tokens_of(events)[0] for events in results] == expected_first
    assert all(len(tokens_of(events)) == 12 for events in results)
