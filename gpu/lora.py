"""LoRA adapters in PEFT's format, many of them in one packed step, none merged into the base weights.

An adapter is a folder as `peft` saves it (`adapter_config.json`, `adapter_model.safetensors`): low-rank
pairs (A [r, in], B [out, r]) for some of a layer's linear projections, scaled by `lora_alpha / r`
(`lora_alpha / sqrt(r)` with rsLoRA). `peft` reads the folder; the batched forward is ours, because a
packed step mixes tokens of many adapters and of the base model in one row.

Each target projection becomes a `LoraLinear`: the base layer (float or packed int8/int4) runs once over
every token of the step, then each token gets its own adapter's delta. The resident adapters sit in
`max_loras` slots, each padded to `max_rank`, stacked so that one step computes

    delta = ((x @ A_all^T) * mask) @ B_all^T        A_all [slots * R, in], B_all [out, slots * R]

where `mask` [tokens, slots * R] is 1 on the columns of a token's slot and 0 elsewhere (and for a base
token). Two matrix products per layer whatever the mix, no per-adapter Python, and no shape that
depends on which adapters a step holds; the cost is `slots * R` columns for every token, which is small
next to the base layer at the ranks adapters use (16 slots of rank 8: 128 columns against 576-1536).
A step without adapter tokens skips the delta altogether.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from contract.plan import LoraRef

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The projections an adapter may target: Llama's names, which most architectures share, and Phi-3's fused
# ones (an adapter on a fused projection is one A and one B like any other: its B spans the fused outputs).
TARGET_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                      "gate_up_proj")
BASE_SLOT = -1  # a token of the base model: no adapter delta
_PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter folder that cannot be served; the message names the file and what is wrong."""


@dataclass(slots=True, frozen=True)
class LoraAdapter:
    name: str
    path: Path
    rank: int
    # projection's module name -> (A [r, in], B [out, r] with the scaling folded in)
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: Path, model: nn.Module, max_rank: int) -> LoraAdapter:
    """Read and check an adapter folder against the base model, on the CPU."""
    from peft import LoraConfig
    from peft.utils import load_peft_weights

    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / file).is_file():
            raise AdapterError(f"adapter '{name}': {path / file} is missing")
    try:
        config = LoraConfig.from_pretrained(str(path))
    except Exception as exc:  # peft raises what the JSON parser or its dataclass raise
        raise AdapterError(f"adapter '{name}': {path / ADAPTER_CONFIG} cannot be read: {exc}") from None
    _check_config(name, path / ADAPTER_CONFIG, config, max_rank)
    try:
        state = load_peft_weights(str(path), device="cpu")
    except Exception as exc:
        raise AdapterError(f"adapter '{name}': {path / ADAPTER_WEIGHTS} cannot be read: {exc}") from None
    scaling = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)
    pairs = _pairs_of(name, path / ADAPTER_WEIGHTS, state, model, config.r, scaling)
    return LoraAdapter(name, path, int(config.r), pairs)


def _check_config(name: str, file: Path, config: Any, max_rank: int) -> None:
    problem = None
    if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA":
        problem = f"peft_type is {config.peft_type}, not LORA"
    elif not 0 < config.r <= max_rank:
        problem = f"rank r={config.r} is over max_lora_rank={max_rank}"
    elif config.use_dora:
        problem = "DoRA (use_dora) is not supported"
    elif config.rank_pattern or config.alpha_pattern:
        problem = "per-module ranks (rank_pattern, alpha_pattern) are not supported"
    elif config.bias != "none" or config.modules_to_save:
        problem = "trained biases and modules_to_save are not supported: only the low-rank pairs are"
    elif config.fan_in_fan_out:
        problem = "fan_in_fan_out is for Conv1D models, not this architecture"
    if problem is not None:
        raise AdapterError(f"adapter '{name}': {file}: {problem}")


def _pairs_of(name: str, file: Path, state: dict[str, torch.Tensor], model: nn.Module, rank: int,
              scaling: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module_name = key.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = state.get(key.replace(".lora_A.", ".lora_B."))
        layer = _target(model, module_name)
        if layer is None or b is None:
            raise AdapterError(f"adapter '{name}': {file}: '{key}' has no {'projection' if b is not None else 'B'} "
                               "to go with it in the base model")
        in_features, out_features = _features(layer)
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise AdapterError(f"adapter '{name}': {file}: '{module_name}' has A {tuple(a.shape)} and B "
                               f"{tuple(b.shape)}; the base model needs ({rank}, {in_features}) and "
                               f"({out_features}, {rank})")
        pairs[module_name] = (a.float(), b.float() * scaling)
    if not pairs:
        raise AdapterError(f"adapter '{name}': {file} holds no LoRA pairs")
    return pairs


def _target(model: nn.Module, module_name: str) -> nn.Module | None:
    if module_name.rsplit(".", 1)[-1] not in TARGET_PROJECTIONS:
        return None
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        return None


def _features(layer: nn.Module) -> tuple[int, int]:
    if isinstance(layer, LoraLinear):
        layer = layer.base
    weight = getattr(layer, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[1]), int(weight.shape[0])
    # a packed quantized layer keeps no float weight; it knows its widths
    packed: Any = layer
    return int(packed.in_features), int(packed.out_features)


def lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Every token's adapter delta: x [tokens, in] -> [tokens, out] (see the module's note)."""
    return ((x @ lora_a.t()) * mask) @ lora_b.t()


def _define_delta_op() -> Any:
    """`fairlane::lora_delta`, opaque to inductor: traced, its products were GEMMs for max-autotune to
    benchmark and for the C++ wrapper to compile, seven per layer, and a cold compile of SmolLM2 with
    16 slots ran past half an hour in one compiler process. Opaque, the compiled step calls ATen's
    matmuls for the delta, as the eager forward does."""
    library = torch.library.Library("fairlane", "FRAGMENT")  # type: ignore[no-untyped-call]
    library.define("lora_delta(Tensor x, Tensor lora_a, Tensor lora_b, Tensor mask) -> Tensor")  # type: ignore[no-untyped-call]
    library.impl("lora_delta", lora_delta, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

    def shape(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], lora_b.shape[0]))

    torch.library.register_fake("fairlane::lora_delta", shape, lib=library)
    return library


_LIBRARY = _define_delta_op()  # kept alive: the op lives as long as its library object


class LoraRows:
    """Which slot each token of the step belongs to, as the mask every LoraLinear multiplies by.
    Set by the runner before each forward; None when no token of the step has an adapter."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None


class LoraLinear(nn.Module):
    """base(x) plus each token's adapter delta (see the module's note)."""

    base: nn.Module
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(self, base: nn.Module, rows: LoraRows, num_slots: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.rows = rows
        in_features, out_features = _features(base)
        self.in_features, self.out_features, self.max_rank = in_features, out_features, max_rank
        param = next(base.parameters(), None)
        buffer = next(base.buffers(), None)
        device = (param if param is not None else buffer).device  # type: ignore[union-attr]
        dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        self.register_buffer("lora_a", torch.zeros(num_slots * max_rank, in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(out_features, num_slots * max_rank, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        mask = self.rows.mask
        if mask is None:
            return out
        flat = x.reshape(-1, self.in_features).to(self.lora_a.dtype)
        delta: torch.Tensor = torch.ops.fairlane.lora_delta(flat, self.lora_a, self.lora_b, mask)
        return out + delta.view(out.shape).to(out.dtype)

    def fill(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's pair in a slot (zero-padded to max_rank), or clear the slot."""
        columns = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        self.lora_a[columns].zero_()
        self.lora_b[:, columns].zero_()
        if pair is not None:
            a, b = pair
            self.lora_a[slot * self.max_rank: slot * self.max_rank + a.shape[0]].copy_(a)
            self.lora_b[:, slot * self.max_rank: slot * self.max_rank + b.shape[1]].copy_(b)


class LoraSlots:
    """The model's LoraLinear layers and the adapters resident in their slots."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.rows = LoraRows()
        self.layers: dict[str, LoraLinear] = {}
        for name, module in list(model.named_modules()):
            if name.rsplit(".", 1)[-1] in TARGET_PROJECTIONS and not isinstance(module, LoraLinear):
                layer = LoraLinear(module, self.rows, num_slots, max_rank)
                model.set_submodule(name, layer)
                self.layers[name] = layer
        self.resident: list[str | None] = [None] * num_slots

    def place(self, slot: int, adapter: LoraAdapter) -> None:
        for name, layer in self.layers.items():
            layer.fill(slot, adapter.pairs.get(name))
        self.resident[slot] = adapter.name

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.fill(slot, None)
        self.resident[slot] = None

    def select(self, token_slots: torch.Tensor | None) -> None:
        """Set the step's tokens' slots ([tokens] ints, BASE_SLOT for the base model), or None."""
        if token_slots is None or bool((token_slots == BASE_SLOT).all()):
            self.rows.mask = None
            return
        self.select_mixed(token_slots)

    def select_mixed(self, token_slots: torch.Tensor) -> None:
        """`select` for slots the caller knows hold some adapter token: no look at the device's values."""
        some_layer = next(iter(self.layers.values()))
        columns = torch.arange(self.num_slots * self.max_rank, device=token_slots.device) // self.max_rank
        self.rows.mask = (token_slots[:, None] == columns[None, :]).to(some_layer.lora_a.dtype)


@dataclass(slots=True, frozen=True)
class LoraServing:
    """How the runner serves adapters: device slots, the rank they are padded to, adapters kept read on the CPU."""

    max_loras: int = 4
    max_rank: int = 16
    max_cpu_loras: int = 8


class AdapterStore:
    """Adapters read from their folders and kept on the CPU, least recently used out past `capacity`.
    The runner's step thread takes adapters from it; the operator endpoint checks a folder through it
    from another thread, hence the lock (held only around the dictionary, never while reading a folder)."""

    def __init__(self, model: nn.Module, capacity: int, max_rank: int) -> None:
        self._model, self._capacity, self._max_rank = model, max(1, capacity), max_rank
        self._read: OrderedDict[LoraRef, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ref: LoraRef) -> LoraAdapter:
        """The adapter, read from its folder on a miss; AdapterError when the folder cannot be served."""
        with self._lock:
            adapter = self._read.get(ref)
            if adapter is not None:
                self._read.move_to_end(ref)
                return adapter
        adapter = read_adapter(ref.name, Path(ref.path), self._model, self._max_rank)
        with self._lock:
            self._read[ref] = adapter
            while len(self._read) > self._capacity:
                self._read.popitem(last=False)
        return adapter

    def forget(self, name: str) -> None:
        """Drop every read version of an adapter (it was unloaded)."""
        with self._lock:
            for ref in [r for r in self._read if r.name == name]:
                del self._read[ref]


class LoraRuntime:
    """The runner's adapters: the device slots and the CPU store they are loaded from."""

    def __init__(self, model: nn.Module, serving: LoraServing) -> None:
        self.slots = LoraSlots(model, serving.max_loras, serving.max_rank)
        self.store = AdapterStore(model, serving.max_cpu_loras, serving.max_rank)

    def load(self, loads: Sequence[tuple[int, LoraRef]]) -> tuple[tuple[int, str], ...]:
        """Put the plan's adapters into their slots (from the CPU store, reading folders on a miss).
        Returns the loads that failed, (slot, why), each slot left empty: a folder deleted or broken
        after it was checked ends that adapter's requests, not the step of everyone else."""
        failed = []
        for slot, ref in loads:
            try:
                self.slots.place(slot, self.store.get(ref))
            except AdapterError as exc:
                self.slots.clear(slot)
                failed.append((slot, str(exc)))
        return tuple(failed)

    def select(self, lora_slots: Sequence[int], num_tokens: Sequence[int], device: torch.device, *,
               always: bool = False) -> None:
        """Set each packed token's slot from its sequence's (in the packed order). No mask when none has
        one, unless `always`: a compiled forward takes a mask at every step (zero rows for base tokens),
        so that one graph serves steps with and without adapters."""
        if all(slot == BASE_SLOT for slot in lora_slots) and not always:
            self.slots.select(None)
            return
        per_sequence = torch.tensor(list(lora_slots), device=device)
        lengths = torch.tensor(list(num_tokens), device=device)
        self.slots.select_mixed(torch.repeat_interleave(per_sequence, lengths, output_size=sum(num_tokens)))
