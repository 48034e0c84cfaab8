"""The runner's packed, paged forward gives the logits of a plain Hugging Face forward."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from contract.plan import StepPlan, StepResult
from gpu.models import LoadedModel
from gpu.runner import ModelRunner
from gpu.step_inputs import decodes_first
from scheduling.request import RequestId
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.factories import has_mixed_step, has_split_prefill, make_request, make_runner
from tests.gpu.reference import byte_prompt, hf_logits

TOLERANCE = 1e-4


def probe_step(runner: ModelRunner, plan: StepPlan) -> tuple[dict[tuple[str, int], torch.Tensor], StepResult]:
    """Run the plan's forward asking for the logits at the end of every chunk, not only the sampled
    ones, so chunks that stop mid-prompt are checked too. Greedy tokens for those that sample."""
    probes = [dataclasses.replace(seq, needs_sample=True) for seq in decodes_first(plan.sequences)]
    logits = runner.compute_logits(probes)
    rows: dict[tuple[str, int], torch.Tensor] = {}
    result = StepResult()
    for probe, original, row in zip(probes, decodes_first(plan.sequences), logits, strict=True):
        rows[(probe.request_id, probe.start_position + len(probe.token_ids) - 1)] = row
        if original.needs_sample:
            result.sampled_token_ids[probe.request_id] = int(torch.argmax(row))
    return rows, result


def test_chunked_and_decode_logits_match_hf(tiny_model: LoadedModel, tiny_reference: Any) -> None:
    runner = make_runner(tiny_model, num_blocks=64, block_size=8)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=24), runner.geometry)
    requests = [make_request(byte_prompt(length, offset=13 * i), max_tokens=6)
                for i, length in enumerate((1, 3, 21, 45, 90))]
    for request in requests:
        scheduler.add_request(request)
    observed: dict[tuple[str, int], torch.Tensor] = {}
    plans: list[StepPlan] = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        rows, result = probe_step(runner, plan)
        observed.update(rows)
        plans.append(plan)
        scheduler.update(plan, result)
    assert has_split_prefill(plans) and has_mixed_step(plans)
    # Causal: row p of one forward over the whole final sequence is the logits after token p.
    references = {request.request_id: hf_logits(tiny_reference, request.token_ids) for request in requests}
    worst = 0.0
    for (request_id, position), row in observed.items():
        reference = references[RequestId(request_id)][position]
        worst = max(worst, float((row.cpu() - reference.cpu()).abs().max()))  # the runner's device, HF's CPU
    assert len(observed) > len(requests) * 6
    assert worst < TOLERANCE, f"largest logit difference {worst:.2e}"
