"""The runner's packed forward, eager or compiled with torch.compile (inductor).

By default one graph covers the whole step: embeddings, every layer and the LM head (scope "model";
scope "layer" compiles one decoder layer that every layer shares, see `compile_decoder_layers`: a
16x shorter compile, a slower step, docs/models.md). In the attention, the pool
write and the prefill chunks are a registered op and the decodes are traced (gpu/attention.py), so
nothing breaks the graph. Every size that
changes from step to step is unbacked: the token count, how many logits are kept, and the step
layout (how many decodes, chunks and context rows). Dynamo then guards on none of them, so one graph
serves a lone decode, 64 decodes and any mix of decodes and prefill chunks. (A separate static graph
for one token measured no faster: 39.5 against 40.0 ms p50 for SmolLM2 in float32, and it doubled
the start-up.) The KV pool's size is unbacked too, so the artifacts of one start serve the next even
when its pool is sized differently. Where the packed layers keep dense copies for large steps
(gpu/linear_kernels.py), a second graph serves the steps of at least that many tokens: the same
forward, told the token count reaches the copies' row count, so that its layers trace the copies'
multiply (`PackedForward._forward_large`).
The graph is compiled over warm-up steps (`warm_up`), at start-up or in the background while the
runner serves eagerly (gpu/background_compile.py), so a request never pays for a compilation; one
that happens later all the same is logged and counted (`recompilations`).

Modes: `eager`, `default` (inductor's defaults), `max` (max-autotune's choice of GEMM kernels, and a
C++ wrapper that launches the kernels without Python between them). Frozen weights (inductor's
`freezing`) measured no faster here and made every start re-trace: its graphs skip the AOT autograd
cache, so a later start compiled in 53-64 s instead of 18 s. Inductor keeps its artifacts on
disk under a folder keyed by the model's architecture, dtype, quantization, mode, scope, torch version
and machine (`artifact_folder`): a second start loads them instead of compiling.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
import platform
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from contract.plan import SamplingParams, ScheduledSequence
from gpu.attention import PagedMetadata
from gpu.lora import LoraRows
from gpu.step_inputs import StepInputs

logger = logging.getLogger(__name__)

CompileMode = Literal["eager", "default", "max"]
# What one compiled graph covers: the whole step ("model"), or one decoder layer, whose compiled code
# every layer of the model shares ("layer": regional compilation, with the embedding, the rotary
# tables and the LM head run eagerly around it).
CompileScope = Literal["model", "layer"]

# Inductor options of each mode (None: eager). max_autotune times GEMM kernels and keeps the fastest;
# cpp_wrapper calls the kernels from C++ (SmolLM2, one decode: 36 against 42 ms p50 with Python's wrapper).
INDUCTOR_OPTIONS: dict[CompileMode, dict[str, Any] | None] = {
    "eager": None,
    "default": {},
    "max": {"max_autotune": True, "cpp_wrapper": True},
}


# The whole-model graph checks no guard on the model's modules before each step: it was 2.4 ms of SmolLM2's
# 28 ms compiled decode (dynamo's cache lookup, profiled), and nothing the graph reads from a module
# changes while a runner serves (the weights are graph inputs, read afresh each step; the modules and
# their shapes stay as loaded). Not for the layer scope, whose graphs are told apart by a module
# attribute (the layer's index). Dynamo pops the key: it reaches no inductor option, nor the artifacts' keys.
MODEL_GUARDS: dict[str, Any] = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


WarmUpProgress = Callable[[int, int, str], None]  # (steps done, steps in all, the step's label)


@dataclass(slots=True, frozen=True)
class CompileConfig:
    """How the runner's forward runs, and where compiled artifacts are kept."""

    mode: CompileMode = "eager"
    cache_dir: str | None = None  # the artifacts' root; None: inductor's own default folder
    scope: CompileScope = "model"
    # Compile in a child process running this command (gpu/background_compile.py) and serve eagerly
    # meanwhile; None: compile now, before the runner is returned.
    child_command: tuple[str, ...] | None = None
    on_warm_up_step: WarmUpProgress | None = None  # told after each warm-up step (the child reports them)


def machine_key(device: torch.device) -> str:
    """What compiled code depends on besides the model: the processor (its instruction sets) or the GPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        return f"{name}-sm{major}{minor}"
    try:
        with open("/proc/cpuinfo") as handle:
            described = "".join(line for line in handle if line.startswith(("model name", "flags")))
    except OSError:
        described = platform.processor()
    return f"{platform.machine()}-{hashlib.sha256(described.encode()).hexdigest()[:12]}"


# Fields of a model's config that name or describe it without changing what its forward computes.
_NAMING_FIELDS = ("_name_or_path", "name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype",
                  "_commit_hash")


def architecture_key(config: Any) -> str:
    """What of a model's config shapes its graph: the architecture and its sizes, not its name or path.
    The weights are graph inputs (nothing is frozen), so two checkpoints of one architecture share a graph:
    a fine-tune finds the artifacts its base model left."""
    described = {key: value for key, value in config.to_dict().items() if key not in _NAMING_FIELDS}
    text = json.dumps(described, sort_keys=True, default=str)
    return f"{config.model_type}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def artifact_folder(root: str, architecture: str, dtype: torch.dtype, variant: str, mode: CompileMode,
                    scope: CompileScope, device: torch.device) -> Path:
    """One folder per combination that compiles to different code, and only those: nothing stale is ever
    picked up, and settings that leave the graph as it is (the KV pool's size, the server's limits, the
    model's name) share their artifacts. Inductor keys each graph by its content inside the folder too."""
    identity = f"{architecture}|{dtype}|{variant}|{mode}|{scope}|{torch.__version__}|{machine_key(device)}"
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", architecture.split("-")[0])[:32]
    return Path(root) / f"{readable}-{scope}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def compiled_marker(folder: Path, block_size: int) -> Path:
    """Written into the artifact folder once a warm-up has compiled every graph into it, so that a later
    start loads the artifacts at once instead of starting a compiling child first. Per block size and
    thread count: both shape the kernels, and neither keys the folder."""
    return folder / f"compiled-block{block_size}-threads{torch.get_num_threads()}.json"


def mark_compiled(folder: Path, block_size: int, forward: PackedForward) -> None:
    marker = {"graphs": forward.num_graphs, "seconds": round(forward.compile_seconds, 1), "scope": forward.scope}
    compiled_marker(folder, block_size).write_text(json.dumps(marker))


def use_artifact_folder(folder: Path) -> None:
    """Point inductor's on-disk caches (FX graphs, AOT autograd, kernels) at the folder. Inductor reads
    this variable whenever it opens its cache, so it must be set before the first compilation."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder.resolve())


def compilations_so_far() -> int:
    """Graphs dynamo has compiled in this process (its own counter)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def mark_metadata_shapes(metadata: PagedMetadata) -> None:
    for tensor, dims in metadata.varying_dims():  # the pool too: its size must not key the artifacts
        for dim in dims:
            torch._dynamo.decorators.mark_unbacked(tensor, dim)


def mark_step_shapes(step: StepInputs, keep: torch.Tensor, lora_mask: torch.Tensor | None = None) -> None:
    """Tell dynamo which sizes vary from step to step (see the module's note)."""
    mark_metadata_shapes(step.metadata)
    for tensor, dim in ((step.input_ids, 1), (step.positions, 1), (keep, 0)):
        torch._dynamo.decorators.mark_unbacked(tensor, dim)
    if lora_mask is not None:  # a row per packed token
        torch._dynamo.decorators.mark_unbacked(lora_mask, 0)


class PackedForward:
    """`model(packed step) -> float32 logits` of the kept rows, eagerly or through a compiled graph."""

    def __init__(self, model: Any, mode: CompileMode, lora_rows: LoraRows | None = None,
                 scope: CompileScope = "model", dense_from_rows: int | None = None) -> None:
        self.model = model
        self.mode = mode
        # Steps of this many tokens or more multiply the quantized layers' dense copies (gpu/linear_kernels.py),
        # in a graph of their own that asserts the token count reaches it (`_forward_large`). Eagerly, such
        # a step took a Zen 4 EPYC 10-20 ms more than compiled at 8-16 decodes of SmolLM2.
        self.dense_from_rows = dense_from_rows
        # With LoRA adapters, the step's slot mask is an input of the graph like the paged metadata: set
        # on the layers inside the forward, so a compiled graph reads each step's mask, not a constant.
        self.lora_rows = lora_rows
        options = INDUCTOR_OPTIONS[mode]
        if options is not None and lora_rows is not None:
            # No C++ wrapper under adapters: its one function calls every op of the step, and with seven
            # adapter deltas per layer (an opaque op each, see gpu/lora.py) gcc compiled SmolLM2's wrapper for
            # over 18 minutes before it was stopped; the Python wrapper calls them at once.
            options = {key: value for key, value in options.items() if key != "cpp_wrapper"}
        if options is not None and options.get("max_autotune") and next(model.parameters()).device.type == "cuda":
            # The first CUDA run (an H200, torch 2.11, triton 3.6): max-autotune benchmarked Triton GEMM
            # templates in this process, some failed at run time, and a CUDA illegal memory access poisoned
            # the process's CUDA context, so every compiled test after it errored. Inductor's guard against
            # candidates that crash: benchmark them in a subprocess. Unverified: docs/benchmarks/gpu.md.
            options = {**options, "autotune_in_subproc": True}
        self.scope: CompileScope = scope if options is not None and lora_rows is None else "model"
        self._compiled: Callable[..., Any] | None = None
        self._compiled_large: Callable[..., Any] | None = None  # steps of dense_from_rows tokens or more
        self._compiled_layer: Callable[..., Any] | None = None  # scope "layer": every decoder layer's forward
        if options is not None and self.scope == "layer":
            self._compiled_layer = compile_decoder_layers(model, options)
        elif options is not None:
            self._compiled = torch.compile(self._forward, fullgraph=True, options={**options, **MODEL_GUARDS})
            if dense_from_rows is not None:
                self._compiled_large = torch.compile(self._forward_large, fullgraph=True,
                                                     options={**options, **MODEL_GUARDS})
        self._compilations_at_start = compilations_so_far()
        self._compilations_at_ready: int | None = None  # dynamo's count once warm_up is done
        self.num_graphs = 0  # compiled by warm_up
        self.recompilations = 0  # compilations after warm_up: a shape nobody planned for
        self.compile_seconds = 0.0

    @property
    def has_large_graph(self) -> bool:
        return self._compiled_large is not None

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None or self._compiled_layer is not None

    def __call__(self, step: StepInputs, keep: torch.Tensor) -> torch.Tensor:
        lora_mask = None if self.lora_rows is None else self.lora_rows.mask
        large = self.runs_dense(step)
        graph = self._compiled_large if large else self._compiled
        regional = self._compiled_layer is not None and not large  # a layer scope's large steps run eagerly
        if graph is None and not regional:
            return self._forward(step.input_ids, step.positions, keep, step.metadata, lora_mask)
        before = compilations_so_far()
        logits: torch.Tensor
        if graph is None:
            assert self._compiled_layer is not None
            mark_metadata_shapes(step.metadata)  # once per step: every layer gets the same metadata
            with compiled_layers_on_this_thread(self._compiled_layer):
                logits = self._forward(step.input_ids, step.positions, keep, step.metadata, lora_mask)
        else:
            mark_step_shapes(step, keep, lora_mask)
            logits = graph(step.input_ids, step.positions, keep, step.metadata, lora_mask)
        if self._compilations_at_ready is not None and compilations_so_far() > before:
            self.recompilations += compilations_so_far() - before
            logger.warning("the forward compiled again during serving (%d tokens, %d logits kept): %d so far",
                           step.input_ids.shape[1], keep.shape[0], self.recompilations)
        return logits

    def runs_dense(self, step: StepInputs) -> bool:
        return self.dense_from_rows is not None and step.input_ids.shape[1] >= self.dense_from_rows

    def _forward_large(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                       metadata: PagedMetadata, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The forward of a step with dense_from_rows tokens or more: told so, the packed layers trace their
        dense copies' multiply (PackedLinear.takes_dense)."""
        assert self.dense_from_rows is not None
        torch._check(input_ids.shape[1] >= self.dense_from_rows)  # type: ignore[no-untyped-call]
        return self._forward(input_ids, positions, keep, metadata, lora_mask)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                 metadata: PagedMetadata, lora_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.lora_rows is not None:
            if lora_mask is not None:  # one row per token: the same size as the step's (unbacked) token count
                torch._check(lora_mask.shape[0] == input_ids.shape[1])  # type: ignore[no-untyped-call]
            self.lora_rows.mask = lora_mask
        output = self.model(input_ids=input_ids, position_ids=positions, logits_to_keep=keep, use_cache=False,
                            paged_metadata=metadata)
        logits: torch.Tensor = output.logits[0].float()
        return logits

    def mark_ready(self, seconds: float) -> None:
        """Warm-up is over: from now on a compilation is a recompilation."""
        self.compile_seconds = seconds
        self._compilations_at_ready = compilations_so_far()
        self.num_graphs = self._compilations_at_ready - self._compilations_at_start


# The compiled layer forward of the regional PackedForward running on each thread (None: eager). Per thread:
# a background load warms a compiled forward up while the runner's thread steps the eager one, over the
# same layer modules.
_REGION = threading.local()


@contextlib.contextmanager
def compiled_layers_on_this_thread(compiled_layer: Callable[..., Any]) -> Iterator[None]:
    _REGION.compiled_layer = compiled_layer
    try:
        yield
    finally:
        _REGION.compiled_layer = None


def decoder_layers(model: Any) -> torch.nn.ModuleList | None:
    """The model's stack of decoder layers, all of one class (transformers' `get_decoder().layers`)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return None
    return layers if len({type(layer) for layer in layers}) == 1 else None


def compile_decoder_layers(model: Any, options: dict[str, Any]) -> Callable[..., Any]:
    """Regional compilation: one compiled function for the decoder layer class, called with each layer
    as its `self`, so dynamo and inductor trace, lower and build one layer instead of every layer of the
    model. Each layer's `forward` is routed through `_layer_forward` once; it runs eagerly unless the
    thread is inside a regional PackedForward's call.

    The layer's index is an input, not a constant (`allow_unspec_int_on_nn_module`): its attention picks
    the layer's pool with it. The first layer still compiles with the index as a constant, the second
    finds it changed and compiles the graph every other layer shares: two graphs in all."""
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no stack of decoder layers of one class to compile "
                         "regionally; use the model scope")
    for layer in layers:
        if "_fairlane_eager_forward" not in layer.__dict__:
            layer.__dict__["_fairlane_eager_forward"] = layer.forward  # nn.Module's setattr would want a Module
            layer.__dict__["forward"] = functools.partial(_layer_forward, layer)
    compiled = torch.compile(type(layers[0]).forward, fullgraph=True, options=options)
    patched: Callable[..., Any] = torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True)(compiled)
    return patched


def _layer_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    # Inside a whole-model graph being traced, the layer is traced as it is (the thread-local is not read).
    compiled = None if torch.compiler.is_compiling() else getattr(_REGION, "compiled_layer", None)
    if compiled is None:
        return layer.__dict__["_fairlane_eager_forward"](hidden_states, *args, **kwargs)
    mark_layer_shapes(hidden_states, kwargs)
    return compiled(layer, hidden_states, *args, **kwargs)


def mark_layer_shapes(hidden_states: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """The per-token sizes of a layer's inputs vary from step to step (the step's metadata is marked once
    per step, by the PackedForward)."""
    torch._dynamo.decorators.mark_unbacked(hidden_states, 1)
    per_token = [kwargs.get("position_ids"), *(kwargs.get("position_embeddings") or ())]
    for tensor in per_token:
        if isinstance(tensor, torch.Tensor) and tensor.dim() > 1:
            torch._dynamo.decorators.mark_unbacked(tensor, 1)


def warm_up_steps(block_size: int, num_blocks: int, large_rows: int | None = None
                  ) -> list[tuple[str, list[ScheduledSequence]]]:
    """Steps of every kind a server meets, over blocks of a still empty pool: one decode, then decodes
    beside a fresh prompt and a chunk that continues a cached context, then a lone prompt chunk, and with
    `large_rows`, a chunk of that many tokens, which the large steps' graph serves. The first step of each
    graph compiles it; the others check that it serves them (a compilation there is logged)."""
    blocks = itertools.count()

    def table(tokens: int) -> tuple[int, ...]:
        return tuple(next(blocks) % num_blocks for _ in range(-(-tokens // block_size)))

    def sequence(name: str, start: int, num_tokens: int) -> ScheduledSequence:
        return ScheduledSequence(f"warm-up-{name}", [1] * num_tokens, start, table(start + num_tokens), True,
                                 SamplingParams())

    steps = [
        ("one decode", [sequence("a", block_size + 2, 1)]),
        ("decodes and prompt chunks", [sequence("b", block_size + 2, 1), sequence("c", 3, 1),
                                       sequence("d", 0, 2 * block_size + 3), sequence("e", block_size, 5)]),
        ("one prompt chunk", [sequence("f", 0, block_size + 1)]),
    ]
    if large_rows is not None:
        steps.append(("a large step", [sequence("g", 0, large_rows)]))
    return steps


def warm_up(forward: PackedForward, compute: Callable[[list[ScheduledSequence]], object], block_size: int,
            num_blocks: int, on_step: WarmUpProgress | None = None) -> None:
    """Compile the graph serving will use before the first request, logging each warm-up step's time.
    `compute` runs one step through `forward` over a pool of at least `num_blocks` blocks."""
    if not forward.is_compiled:
        return
    steps = warm_up_steps(block_size, num_blocks, forward.dense_from_rows if forward.has_large_graph else None)
    logger.info("compiling the forward (mode %s, scope %s) over %d warm-up steps: minutes on a first start, "
                "seconds on one that finds the artifacts on disk", forward.mode, forward.scope, len(steps))
    started = time.perf_counter()
    for index, (label, sequences) in enumerate(steps, start=1):
        step_started = time.perf_counter()
        compute(sequences)
        logger.info("warm-up step %d of %d (%s): %.1f s", index, len(steps), label, time.perf_counter() - step_started)
        if on_step is not None:
            on_step(index, len(steps), label)
    forward.mark_ready(time.perf_counter() - started)
    logger.info("the forward is compiled: %d graphs in %.1f s", forward.num_graphs, forward.compile_seconds)
