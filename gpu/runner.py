"""The model runner: executes a `StepPlan` (swaps, one packed forward, sampling) -> `StepResult`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from contract.plan import CacheGeometry, LoraRef, ScheduledSequence, StepPlan, StepResult, StructuredOutput, TierCopies
from gpu.attention import ATTENTION_NAME
from gpu.background_compile import BackgroundCompile, CompileStatus
from gpu.capabilities import capability_line, probe_attention, text_config_of
from gpu.compiled import (
    CompileConfig,
    PackedForward,
    architecture_key,
    artifact_folder,
    compiled_marker,
    mark_compiled,
    use_artifact_folder,
    warm_up,
)
from gpu.draft import DraftProposer
from gpu.kv_cache import KVShape, PagedKVCache
from gpu.kv_disk import DiskBlockStore
from gpu.kv_handoff import KVPublisher
from gpu.lora import LoraRows, LoraRuntime, LoraServing
from gpu.models import LoadedModel
from gpu.prompt_logprobs import prompt_logprobs, prompt_rows
from gpu.sampler import Sampler
from gpu.step_inputs import build_step_inputs, decodes_first
from gpu.structured import GrammarCache, GrammarMatchers, TokenMasks, check
from gpu.verification import num_rows, verify_step

logger = logging.getLogger(__name__)

# The pool a background load runs its warm-up steps over: its own, so that they never write into blocks
# the requests being served hold. warm_up_steps needs about a dozen blocks; the graph takes any pool size.
SCRATCH_POOL_BLOCKS = 32


@dataclass(slots=True, frozen=True)
class RunnerBudget:
    """The memory the runner may take, in bytes, and the block size."""

    block_size: int
    kv_cache_bytes: int | None  # None: kv_cache_memory_fraction of the memory free now
    swap_space_bytes: int
    max_model_len: int | None = None
    seed: int = 0
    kv_cache_memory_fraction: float = 0.25
    max_num_seqs: int = 64  # the automatic pool never holds more than this many full-length sequences
    # The prefix cache's lower tiers (scheduling/cache_tiers.py): host memory, and files under a folder.
    host_cache_bytes: int = 0
    disk_cache_path: str | None = None
    disk_cache_bytes: int = 0
    kv_cache_dtype: torch.dtype | None = None  # the pools' dtype; None: the model's


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def kv_pool_bytes(budget: RunnerBudget, bytes_per_block: int, max_model_len: int, device: torch.device) -> int:
    """The bytes setting when given; else a share of the free memory (as vLLM sizes its pool from the
    device memory left after loading), capped at what max_num_seqs sequences of max_model_len need."""
    if budget.kv_cache_bytes is not None:
        return budget.kv_cache_bytes
    share = int(budget.kv_cache_memory_fraction * free_memory_bytes(device))
    blocks_per_sequence = -(-max_model_len // budget.block_size)
    return min(share, budget.max_num_seqs * blocks_per_sequence * bytes_per_block)


def kv_shape_of(loaded: LoadedModel, block_size: int, kv_dtype: torch.dtype | None = None) -> KVShape:
    config = text_config_of(loaded.model.config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KVShape(config.num_hidden_layers, kv_heads, head_dim, block_size, kv_dtype or loaded.dtype, loaded.dtype)


class ModelRunner:
    """Owns the model, the KV pools and the sampler. Called from one worker thread only."""

    def __init__(self, loaded: LoadedModel, budget: RunnerBudget, compilation: CompileConfig | None = None,
                 lora: LoraServing | None = None, draft: LoadedModel | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.model.set_attn_implementation(ATTENTION_NAME)
        shape = kv_shape_of(loaded, budget.block_size, budget.kv_cache_dtype)
        self.attention = probe_attention(loaded.name, self.model, shape, loaded.device)
        logger.info("%s", capability_line(loaded.name, self.model.config, self.attention))
        # The adapters wrap the linear layers before the forward is built; None: the base model alone.
        self.lora = None if lora is None else LoraRuntime(self.model, lora)
        compilation = compilation or CompileConfig()
        self.device = loaded.device
        max_len = min(loaded.max_model_len, budget.max_model_len or loaded.max_model_len)
        pool_bytes = kv_pool_bytes(budget, shape.bytes_per_block, max_len, self.device)
        self.cache = PagedKVCache(shape, pool_bytes // shape.bytes_per_block,
                                  budget.swap_space_bytes // shape.bytes_per_block, self.device,
                                  budget.host_cache_bytes // shape.bytes_per_block)
        self.disk = self._disk_tier(budget, shape, max_len)
        self.publisher: KVPublisher | None = None  # a prefill replica's KV hand-off (gpu/kv_handoff.py)
        logger.info("KV pool: %d blocks of %d tokens, %d tokens in all (%.0f MiB of %s)",
                    self.cache.num_device_blocks, budget.block_size, self.cache.num_device_blocks * budget.block_size,
                    self.cache.num_device_blocks * shape.bytes_per_block / 2**20, shape.dtype)
        self.sampler = Sampler(self.device, budget.seed)
        # A draft model proposes for speculative decoding over a pool of as many blocks (gpu/draft.py).
        self.draft = None if draft is None else DraftProposer(draft, kv_shape_of(draft, budget.block_size),
                                                              self.cache.num_device_blocks)
        self.grammars = GrammarCache(loaded.tokenizer, int(self.model.config.vocab_size))
        self.matchers = GrammarMatchers(self.grammars)
        disk = self.disk
        self._geometry = CacheGeometry(self.cache.num_device_blocks, self.cache.num_cpu_blocks,
                                       budget.block_size, shape.bytes_per_block, max_len, self.cache.num_host_blocks,
                                       0 if disk is None else disk.capacity_blocks,
                                       () if disk is None else tuple(disk.stored()))
        self.artifact_folder = self._artifact_folder(compilation)
        self.background: BackgroundCompile | None = None  # set when the forward is compiled after start-up
        self._awaits_compiled = False  # until the switch: each step asks the background compile, then none
        if compilation.mode != "eager" and compilation.child_command is not None:
            self.forward = PackedForward(self.model, "eager", self._lora_rows())
            # A folder a warm-up has filled before: no child to wait for, the artifacts are loaded at once.
            found = (self.artifact_folder is not None
                     and compiled_marker(self.artifact_folder, budget.block_size).is_file())
            self.background = BackgroundCompile(None if found else compilation.child_command,
                                                lambda: self._load_compiled(compilation),
                                                load_on_step_thread=self.lora is not None)
            self._awaits_compiled = True
        else:
            self.forward = self._packed_forward(compilation)
            warm_up(self.forward, self.compute_logits, budget.block_size, self.cache.num_device_blocks,
                    compilation.on_warm_up_step)
            if self.artifact_folder is not None and self.forward.is_compiled:
                mark_compiled(self.artifact_folder, budget.block_size, self.forward)

    def _disk_tier(self, budget: RunnerBudget, shape: KVShape, max_len: int) -> DiskBlockStore | None:
        """The files of the prefix cache's disk tier, for this model and layout only: a block is valid for
        the same weights (name, dtype, quantization) and the same KV layout."""
        if budget.disk_cache_path is None or not self.cache.num_host_blocks:
            return None
        store = DiskBlockStore(budget.disk_cache_path, self.block_file_config(), self.block_file_shape(),
                               shape.dtype, budget.disk_cache_bytes)
        logger.info("prefix cache on disk: %s, %d blocks found, room for %d", budget.disk_cache_path,
                    len(store.stored()), store.capacity_blocks)
        return store

    def block_file_config(self) -> dict[str, str | int]:
        """What makes a block file valid: the same weights (name, dtype, quantization) and KV layout."""
        shape = self.cache.shape
        config: dict[str, str | int] = {
            "model": self.loaded.name, "dtype": str(shape.dtype), "quantization": self.loaded.quantization,
            "block_size": shape.block_size, "layers": shape.num_layers, "kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "vocab_size": int(self.model.config.vocab_size)}
        if shape.dtype != self.loaded.dtype:  # values computed in one dtype, kept in another
            config["model_dtype"] = str(self.loaded.dtype)
        return config

    def block_file_shape(self) -> tuple[int, ...]:
        """One block, all layers, as the host tier and block files hold it."""
        shape = self.cache.shape
        return (shape.num_layers, 2, shape.num_kv_heads, shape.block_size, shape.head_dim)

    def publish_to(self, publisher: KVPublisher) -> None:
        """Publish the prompts that plans mark (StepPlan.publishes) through this publisher: a prefill replica."""
        self.publisher = publisher

    def close(self) -> None:
        """Finish the disk tier's queued writes (a restart finds them); stop a background compilation."""
        if self.background is not None:
            self.background.close()
        if self.disk is not None:
            self.disk.close()
        if self.publisher is not None:
            self.publisher.close()

    def start_compiling(self) -> None:
        """Start the background compilation, if this runner has one (once the server is up)."""
        if self.background is not None:
            self.background.start()

    @property
    def awaits_compiled_forward(self) -> bool:
        """Whether a compiled forward will replace the one serving now (timing the one now is then waste)."""
        return self._awaits_compiled

    @property
    def compile_status(self) -> CompileStatus | None:
        """Where a background compilation stands; None when the forward was ready at start-up."""
        return None if self.background is None else self.background.status

    def _load_compiled(self, compilation: CompileConfig) -> PackedForward:
        """The compiled forward, warmed up over a scratch pool of its own (a background load runs beside
        the steps serving requests, on another thread)."""
        forward = self._packed_forward(compilation)
        scratch = PagedKVCache(self.cache.shape, SCRATCH_POOL_BLOCKS, 0, self.device)
        warm_up(forward, lambda sequences: self._logits(sequences, (), scratch, forward),
                self.cache.shape.block_size, SCRATCH_POOL_BLOCKS)
        return forward

    def _take_compiled_forward(self) -> bool:
        """Between two steps: switch to the compiled forward once the background load has it. True when
        this step is the first to run it."""
        assert self.background is not None
        compiled = self.background.take_ready()
        if compiled is None:
            return False
        self.forward = compiled
        self._awaits_compiled = False
        logger.info("steps now run the compiled forward (mode %s, scope %s)", compiled.mode, compiled.scope)
        return True

    def _artifact_folder(self, compilation: CompileConfig) -> Path | None:
        if compilation.mode == "eager" or compilation.cache_dir is None:
            return None
        return artifact_folder(compilation.cache_dir, architecture_key(self.model.config), self.loaded.dtype,
                               self._graph_variant(), compilation.mode, compilation.scope, self.device)

    def _packed_forward(self, compilation: CompileConfig) -> PackedForward:
        if self.artifact_folder is not None:
            use_artifact_folder(self.artifact_folder)
            logger.info("compiled artifacts: %s", self.artifact_folder)
        return PackedForward(self.model, compilation.mode, self._lora_rows(), compilation.scope,
                             self.loaded.kernel_plan.dense_from_rows)

    def _lora_rows(self) -> LoraRows | None:
        return None if self.lora is None else self.lora.slots.rows

    def _graph_variant(self) -> str:
        """What besides the model, dtype and mode shapes the graph: the quantization, the dense copies and
        the rows from which the large steps' graph takes them, the LM head's copy, the KV pool's dtype
        where it is not the model's, and the LoRA slots."""
        variant: str = self.loaded.quantization + self.loaded.kernel_plan.graph_variant()
        if self.cache.shape.dtype != self.loaded.dtype:
            variant += f"+kv-{self.cache.shape.dtype}"
        if self.lora is not None:
            variant += f"+lora{self.lora.slots.num_slots}x{self.lora.slots.max_rank}"
        return variant

    def check_adapter(self, adapter: LoraRef) -> None:
        """Read and check an adapter's folder against the model, keeping it in the CPU store; AdapterError
        names the file when it cannot be served. Reads files: call it off the event loop."""
        if self.lora is None:
            raise ValueError("this runner serves no LoRA adapters (enable_lora is off)")
        self.lora.store.get(adapter)

    def forget_adapter(self, name: str) -> None:
        if self.lora is not None:
            self.lora.store.forget(name)

    @property
    def geometry(self) -> CacheGeometry:
        return self._geometry

    def check_structured(self, structured: StructuredOutput) -> None:
        """ValueError when the grammar does not compile (for the API layer: a 400 before submitting).
        Compiles into the runner's cache; about a millisecond, but the first structured request also
        reads the tokenizer (0.5 s for SmolLM2): call it off the event loop."""
        check(structured, self.grammars)

    def execute(self, plan: StepPlan) -> StepResult:
        forward_changed = self._awaits_compiled and self._take_compiled_forward()
        swap_started = time.perf_counter()
        failed_reads = self._copy_between_tiers(plan.tier_copies) if plan.tier_copies else ()
        self.cache.swap_out(plan.swap_out)
        self.cache.swap_in(plan.swap_in)
        result = StepResult(swap_seconds=time.perf_counter() - swap_started, failed_disk_reads=failed_reads,
                            lost_disk_blocks=tuple(self.disk.take_lost()) if self.disk is not None else (),
                            forward_changed=forward_changed)
        self.sampler.forget(plan.finished_request_ids)
        self.matchers.forget(plan.finished_request_ids)
        if self.draft is not None:
            self.draft.forget(plan.finished_request_ids)
        if self.lora is not None:
            result.failed_lora_loads = self.lora.load(plan.lora_loads)
        if not plan.sequences:
            return result
        sequences = self.matchers.cut_drafts(plan.sequences) if self._has_constrained_drafts(plan) else plan.sequences
        ordered = decodes_first(sequences)
        sampling = [seq for seq in ordered if seq.needs_sample]
        masks = self.matchers.masks(sampling)
        forward_started = time.perf_counter()
        extra = prompt_rows(ordered)
        recompilations = self.forward.recompilations
        logits = self.compute_logits(ordered, extra.rows)
        if self.device.type == "cuda":  # else the time would be the kernels' launch, not their run
            torch.cuda.synchronize(self.device)
        result.forward_seconds = time.perf_counter() - forward_started
        result.recompilations = self.forward.recompilations - recompilations
        num_sampled_rows = sum(num_rows(seq) for seq in sampling)
        if not extra.is_empty:
            result.prompt_logprobs = prompt_logprobs(logits[num_sampled_rows:], extra, ordered)
            logits = logits[:num_sampled_rows]
        if num_sampled_rows > len(sampling):  # some sequences verify proposed tokens
            self._verify(logits, sampling, masks, result)
        elif sampling:
            tokens, result.logprobs = self.sampler.sample_step(logits, sampling, masks)
            self.matchers.advance(sampling, tokens)
            result.sampled_token_ids = {s.request_id: t for s, t in zip(sampling, tokens, strict=True)}
        if plan.publishes and self.publisher is not None:  # after the forward: the last chunk's KV is written
            for hashes, blocks in plan.publishes:
                self.publisher.publish([(h, self.cache.device_block(b)) for h, b in zip(hashes, blocks, strict=True)])
        if self.draft is not None:
            result.proposals = self.draft.propose(
                [(seq.request_id, [*seq.prompt_token_ids, *seq.output_token_ids, *result.tokens_of(seq.request_id)],
                  seq.num_proposals_wanted) for seq in sampling if seq.num_proposals_wanted])
        return result

    @staticmethod
    def _has_constrained_drafts(plan: StepPlan) -> bool:
        return any(seq.num_draft_tokens and seq.sampling.structured is not None for seq in plan.sequences)

    def _verify(self, logits: torch.Tensor, sampling: list[ScheduledSequence], masks: TokenMasks | None,
                result: StepResult) -> None:
        """A step with proposals: sequences that had some answer in `verified`, the others as usual."""
        emitted, logprobs = verify_step(self.sampler, logits, sampling, masks)
        self.matchers.advance([seq for seq, tokens in zip(sampling, emitted, strict=True) for _ in tokens],
                              [token for tokens in emitted for token in tokens])
        for seq, tokens in zip(sampling, emitted, strict=True):
            if seq.num_draft_tokens:
                result.verified[seq.request_id] = tuple(tokens)
                if seq.request_id in logprobs:
                    result.verified_logprobs[seq.request_id] = logprobs[seq.request_id]
            else:
                result.sampled_token_ids[seq.request_id] = tokens[0]
                if seq.request_id in logprobs:
                    result.logprobs[seq.request_id] = logprobs[seq.request_id][0]

    def _copy_between_tiers(self, copies: TierCopies) -> tuple[bytes, ...]:
        """The prefix cache's copies, in the order `TierCopies` says; the hashes of disk reads that failed.
        Device blocks are written down before anything of the step may overwrite them, and copied up
        before the forward reads them."""
        if self.disk is not None:  # host blocks lent to queued disk writes are taken back before reuse
            self.disk.reclaim([host for _, host in copies.offloads] + [host for _, host in copies.disk_reads])
        self.cache.offload(copies.offloads)
        failed: list[bytes] = []
        if self.disk is not None:
            for block_hash in copies.disk_deletes:
                self.disk.delete(block_hash)
            for host_block, block_hash in copies.disk_writes:  # queued: the writer thread copies and writes
                self.disk.write(block_hash, self.cache.host_block(host_block), lent_slot=host_block)
            failed = [block_hash for block_hash, host_block in copies.disk_reads
                      if not self.disk.read_into(block_hash, self.cache.host_block(host_block))]
        self.cache.onload(copies.onloads)
        return tuple(failed)

    def compute_logits(self, sequences: Sequence[ScheduledSequence], extra_rows: Sequence[int] = ()
                       ) -> torch.Tensor:
        """One packed forward. Returns float32 logits, one row per sequence that needs a sample,
        in the order given, then one per extra packed-token row. Sequences of one token must come
        first (see `decodes_first`)."""
        return self._logits(sequences, extra_rows, self.cache, self.forward)

    @torch.inference_mode()
    def _logits(self, sequences: Sequence[ScheduledSequence], extra_rows: Sequence[int], cache: PagedKVCache,
                forward: PackedForward) -> torch.Tensor:
        step = build_step_inputs(sequences, cache)
        if self.lora is not None:
            self.lora.select([s.lora_slot for s in sequences], [len(s.token_ids) for s in sequences], self.device,
                             always=forward.is_compiled)
        keep = step.logits_indices
        if extra_rows:
            keep = torch.cat([keep, torch.tensor(list(extra_rows), dtype=keep.dtype, device=keep.device)])
        return forward(step, keep)
