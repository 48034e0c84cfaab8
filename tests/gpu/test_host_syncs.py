"""The runner's host syncs and host-to-device copies per step, counted on the CPU against a budget.

On a GPU every read of a device value on the host (`.item()`, `.tolist()`, `int(t)`, a boolean mask,
`nonzero`, a copy to the CPU) waits for the queued kernels: a step that makes several stalls the
device between them. On the CPU nothing waits, but the same calls are made, so a torch function mode
counts them over whole steps. The budget is today's count: a change that adds a sync fails here and
has to say why it needs one (or lower the budget when it removes one). The same holds for the copies
from host to device (`torch.tensor(data, device=...)`, `.to(device)`): on a GPU each is a transfer
the step waits on before its kernels can read it, so they are counted per step too: a fixed number,
whatever the number of sequences."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from contract.plan import SamplingParams, ScheduledSequence, StepPlan
from gpu.models import LoadedModel
from gpu.runner import ModelRunner
from tests.factories import make_runner

BLOCK_SIZE = 8
READS_TO_HOST: set[Callable[..., Any]] = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy, torch.nonzero, torch.Tensor.nonzero,
    torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
}


class HostReads(TorchFunctionMode):
    """Counts the calls that would wait for the device, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in READS_TO_HOST or (func is torch.Tensor.__getitem__ and _has_mask(args)):
            self.counts[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


class HostToDevice(TorchFunctionMode):
    """Counts the calls that would copy host data to the device: tensors made from Python data or host
    tensors with a device given, and `.to(device)`. Allocations on the device (`empty`, `arange`) copy
    nothing and are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            self.counts[func.__name__] += 1
        elif func is torch.Tensor.to and ("device" in kwargs or any(isinstance(a, torch.device | str)
                                                                     for a in args[1:])):
            self.counts["to"] += 1
        return func(*args, **kwargs)


def _has_mask(args: tuple[Any, ...]) -> bool:
    index = args[1] if len(args) > 1 else None
    indices = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def decodes(num: int, context: int = 20) -> list[ScheduledSequence]:
    return [ScheduledSequence(f"d{i}", [5], context, tuple(range(3 * i, 3 * i + 3)), True, SamplingParams())
            for i in range(num)]


def prompt_chunk(name: str, start: int, length: int, first_block: int) -> ScheduledSequence:
    num_blocks = -(-(start + length) // BLOCK_SIZE)
    return ScheduledSequence(name, [7] * length, start, tuple(range(first_block, first_block + num_blocks)), True,
                             SamplingParams(temperature=0.8, top_k=20, top_p=0.9))


def reads_in_step(runner: ModelRunner, sequences: list[ScheduledSequence]) -> Counter[str]:
    return counted_in_step(runner, sequences, HostReads())


def copies_in_step(runner: ModelRunner, sequences: list[ScheduledSequence]) -> Counter[str]:
    return counted_in_step(runner, sequences, HostToDevice())


def counted_in_step(runner: ModelRunner, sequences: list[ScheduledSequence], mode: HostReads | HostToDevice
                    ) -> Counter[str]:
    runner.execute(StepPlan(sequences))  # warm: first calls may initialize lazily
    with mode:
        runner.execute(StepPlan(sequences))
    return mode.counts


@pytest.fixture(scope="module")
def runner(tiny_model: LoadedModel) -> ModelRunner:
    return make_runner(tiny_model, num_blocks=256, block_size=BLOCK_SIZE)


def test_a_decode_step_reads_the_device_once(runner: ModelRunner) -> None:
    """The sampled tokens, and nothing else, whether 1 or 32 sequences decode."""
    assert sum(reads_in_step(runner, decodes(1)).values()) == 1
    assert reads_in_step(runner, decodes(32)) == reads_in_step(runner, decodes(1))


def test_a_mixed_step_with_sampling_stays_within_its_budget(runner: ModelRunner) -> None:
    sequences = [*decodes(3), prompt_chunk("fresh", 0, 13, 100), prompt_chunk("cached", 16, 5, 120)]
    reads = reads_in_step(runner, sequences)
    # the sampled tokens, and the prefill layout (a CPU tensor by design: no wait on a GPU) read as
    # numbers by the attention of each layer; and on the CPU only, whether top-p's candidates hold every
    # row's nucleus (gpu/sampler.py: a GPU sorts the rows instead)
    assert sum(reads.values()) <= 2 + runner.model.config.num_hidden_layers, reads



def test_a_step_copies_to_the_device_a_fixed_number_of_times(runner: ModelRunner) -> None:
    """The step's metadata (positions, slots, block tables, lengths, sampling) goes up in 7 copies
    whether 1 or 32 sequences decode; a mixed step with prompt chunks in 10 (today's counts)."""
    assert sum(copies_in_step(runner, decodes(1)).values()) == 7
    assert copies_in_step(runner, decodes(32)) == copies_in_step(runner, decodes(1))
    mixed = [*decodes(3), prompt_chunk("fresh", 0, 13, 100), prompt_chunk("cached", 16, 5, 120)]
    assert sum(copies_in_step(runner, mixed).values()) <= 10
