"""Builds the engine from the settings: model, runner, scheduler. The one place they meet."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from config.settings import Settings, SettingsError
from gpu.attention import UnsupportedAttention
from gpu.compiled import CompileConfig, CompileMode, CompileScope, WarmUpProgress
from gpu.kv_cache import resolve_kv_cache_dtype
from gpu.lora import LoraServing
from gpu.models import LoadedModel, load_model
from gpu.runner import ModelRunner, RunnerBudget
from scheduling.engine import Engine
from scheduling.follow_up import FollowUpWait
from scheduling.scheduler import Scheduler, SchedulerConfig
from scheduling.speculation import SpeculationConfig
from scheduling.step_shaper import ShapingConfig
from tenancy.tenants import TenantRegistry, load_tenants
from tenancy.vtc import ServiceWeights

# Per mode, the scope `--compile-scope auto` picks (see compile_scope_of).
AUTO_SCOPE: dict[CompileMode, CompileScope] = {"eager": "model", "default": "model", "max": "model"}


def load_model_for(settings: Settings) -> LoadedModel:
    return load_model(settings.model, device=settings.device, dtype=settings.dtype, seed=settings.seed,
                      cache_dir=settings.model_cache_dir, quantization=settings.quantization,
                      linear_kernels=settings.linear_kernels, kernel_plan_dir=settings.compile_cache_dir)


def build_runner(settings: Settings, loaded: LoadedModel, *, compile_in_background: bool = False) -> ModelRunner:
    """The runner of the settings. With compile_in_background (and a compiled mode), it serves eagerly at
    once while a child process compiles its forward; else it compiles before it returns."""
    budget = RunnerBudget(block_size=settings.block_size, kv_cache_bytes=settings.kv_cache_bytes,
                          swap_space_bytes=settings.swap_space_bytes, max_model_len=settings.max_model_len,
                          seed=settings.seed, kv_cache_memory_fraction=settings.kv_cache_memory_fraction,
                          max_num_seqs=settings.max_num_seqs, host_cache_bytes=settings.kv_host_cache_bytes,
                          disk_cache_path=settings.kv_disk_cache_path, disk_cache_bytes=settings.kv_disk_cache_bytes,
                          kv_cache_dtype=kv_cache_dtype_of(settings, loaded))
    child = compile_child_command(settings) if compile_in_background and settings.compile_mode != "eager" else None
    return ModelRunner(loaded, budget, compile_config_of(settings, child_command=child), lora_serving_of(settings),
                       load_draft_for(settings, loaded))


def kv_cache_dtype_of(settings: Settings, loaded: LoadedModel) -> torch.dtype:
    return resolve_kv_cache_dtype(settings.kv_cache_dtype, loaded.dtype, loaded.device)


def compile_config_of(settings: Settings, *, child_command: tuple[str, ...] | None = None,
                      on_warm_up_step: WarmUpProgress | None = None) -> CompileConfig:
    """The settings' compilation, for the server and its compiling child alike: the artifact folder is
    keyed by mode and scope, so the child must resolve them as the server does or fill a folder the
    server never reads."""
    return CompileConfig(settings.compile_mode, settings.compile_cache_dir, compile_scope_of(settings),
                         child_command=child_command, on_warm_up_step=on_warm_up_step)


def compile_scope_of(settings: Settings) -> CompileScope:
    """`auto`: the scope whose step measured faster in this mode (docs/models.md, `fairlane bench compile`)."""
    if settings.compile_scope != "auto":
        return settings.compile_scope
    return AUTO_SCOPE[settings.compile_mode]


def compile_child_command(settings: Settings) -> tuple[str, ...]:
    """`fairlane compile` for these settings, as the child that compiles while the server answers. It
    runs torch with this thread's thread count: inductor generates its kernels for a number of threads,
    and artifacts made for another count would not be found by this process."""
    return (sys.executable, "-m", "app.process.compile_command", "--settings-json", settings.model_dump_json(),
            "--threads", str(torch.get_num_threads()), "--progress-json", "--exit-with-parent")


def lora_serving_of(settings: Settings) -> LoraServing | None:
    if not settings.enable_lora:
        return None
    return LoraServing(settings.max_loras, settings.max_lora_rank, settings.cpu_lora_capacity)


def scheduler_config_of(settings: Settings) -> SchedulerConfig:
    weights = ServiceWeights(settings.vtc_prompt_weight, settings.vtc_decode_weight, settings.cached_token_weight,
                             settings.cache_write_weight)
    return SchedulerConfig(max_num_seqs=settings.max_num_seqs,
                           max_num_batched_tokens=settings.max_num_batched_tokens,
                           long_prefill_token_threshold=settings.long_prefill_token_threshold,
                           queue_policy=settings.queue_policy, queue_order=settings.queue_order,
                           queue_aging_s=settings.queue_aging_s, queue_fcfs_stretch=settings.queue_fcfs_stretch,
                           preemption_mode=settings.preemption_mode,
                           batch_min_share=settings.batch_min_share,
                           service_weights=weights,
                           enable_prefix_caching=settings.enable_prefix_caching,
                           shaping=shaping_config_of(settings),
                           max_loras=settings.max_loras if settings.enable_lora else 0,
                           max_pinned_blocks_per_tenant=settings.cache_pin_max_tokens // settings.block_size,
                           speculation=speculation_config_of(settings))


def speculation_config_of(settings: Settings) -> SpeculationConfig | None:
    spec = settings.speculative_config
    if spec is None:
        return None
    return SpeculationConfig(spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def load_draft_for(settings: Settings, loaded: LoadedModel) -> LoadedModel | None:
    """The draft model of speculative decoding, on the served model's device and in its dtype; SettingsError
    when its tokenizer is not the served model's (its proposals would be other tokens' ids)."""
    spec = settings.speculative_config
    if spec is None or spec.model is None:
        return None
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[loaded.dtype]
    draft = load_model(spec.model, device=loaded.device.type, dtype=dtype, seed=settings.seed,
                       cache_dir=settings.model_cache_dir)
    probe = "Hello, world! 12345 ünïcode\n\tend"
    if (int(draft.model.config.vocab_size) != int(loaded.model.config.vocab_size)
            or draft.tokenizer.encode(probe) != loaded.tokenizer.encode(probe)):
        raise SettingsError(f"the draft model {spec.model} does not share {settings.model}'s tokenizer")
    return draft


def shaping_config_of(settings: Settings) -> ShapingConfig:
    target_ms, arrival_ms = settings.interactive_itl_target_ms, settings.interactive_arrival_budget_ms
    return ShapingConfig(enabled=settings.step_shaping,
                         interactive_itl_target_s=None if target_ms is None else target_ms / 1000,
                         interactive_itl_slack=settings.interactive_itl_slack,
                         interactive_itl_decodes=settings.interactive_itl_decodes,
                         interactive_batch_share=settings.interactive_batch_share,
                         interactive_itl_decodes_cross_tenant=settings.interactive_itl_decodes_cross_tenant,
                         served_less_step_slack=settings.served_less_step_slack,
                         interactive_ttft_slack=settings.interactive_ttft_slack,
                         arrival_budget_s=None if arrival_ms is None else arrival_ms / 1000,
                         arrival_budget_decodes=settings.interactive_arrival_budget_decodes,
                         arrival_window_s=settings.interactive_arrival_window_s,
                         saved_room_budgets=settings.interactive_saved_room_budgets,
                         long_prompt_tokens=settings.interactive_long_prompt_tokens,
                         long_prompt_chunk_budgets=settings.interactive_long_prompt_chunk_budgets,
                         long_prompt_chunk_window_s=settings.interactive_long_prompt_chunk_window_s)


def tenants_of(settings: Settings) -> TenantRegistry:
    """The tenants file's tenants, or the single unauthenticated `default` tenant."""
    return load_tenants(settings.tenants_file) if settings.tenants_file else TenantRegistry.single_default()


def build_engine(settings: Settings, loaded: LoadedModel | None = None, tenants: TenantRegistry | None = None, *,
                 compile_in_background: bool = False) -> tuple[Engine, ModelRunner]:
    tenants = tenants or tenants_of(settings)  # a bad tenants file stops start-up before the model loads
    # The model loads, compiles and runs every step on one thread. On a CPU, torch's OpenMP threads
    # belong to the thread that launched them: a forward from a second thread after the first had
    # run the model measured 2-2.5x slower on 2 cores (SmolLM2 one-token step: 97 against 37 ms).
    step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fairlane-step")

    def build_on_step_thread() -> ModelRunner:
        if settings.torch_threads is not None:  # replicas sharing a machine's cores, one share each
            torch.set_num_threads(settings.torch_threads)
        return build_runner(settings, loaded or load_model_for(settings), compile_in_background=compile_in_background)

    try:
        runner = step_thread.submit(build_on_step_thread).result()
    except UnsupportedAttention as exc:  # a model refused by name: a bad --model, said in one line
        step_thread.shutdown()
        raise SettingsError(str(exc)) from exc
    except BaseException:
        step_thread.shutdown()
        raise
    scheduler = Scheduler(scheduler_config_of(settings), runner.geometry, tenants)
    return Engine(scheduler, runner, max_queued_requests=settings.max_queued_requests,
                  batch_queue_fraction=settings.batch_queue_fraction,
                  stall_after_s=settings.engine_stall_s, step_thread=step_thread,
                  calibrate=settings.step_shaping,
                  follow_up=FollowUpWait(settings.interactive_follow_up_wait_ms / 1000)), runner
