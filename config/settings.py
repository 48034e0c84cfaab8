"""The one settings object, and the only code that reads the environment or config files.

Precedence, lowest first: defaults, a TOML file, `FAIRLANE_*` environment variables, explicit
overrides (command-line flags). Unknown keys are an error that names the key.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENV_PREFIX = "FAIRLANE_"
MiB = 1024 * 1024


class SettingsError(ValueError):
    """A setting is unknown or invalid; the message names it."""


class SpeculativeConfig(BaseModel):
    """Speculative decoding, with vLLM's `--speculative-config` keys (scheduling/speculation.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # ngram: prompt lookup over the request's own tokens; suffix: the same, then over its tenant's recent
    # outputs; draft_model: `model` (any model spec fairlane loads, with the served model's tokenizer) proposes.
    method: Literal["ngram", "suffix", "draft_model"]
    num_speculative_tokens: int = Field(default=4, ge=1, le=16)
    prompt_lookup_min: int = Field(default=2, ge=1)
    prompt_lookup_max: int = Field(default=5, ge=1)
    model: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check_keys(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("model is the draft model's spec: method draft_model needs it, and only it takes it")
        return self


class AdapterEntry(BaseModel):
    """A LoRA adapter served from start-up: `[[adapters]]` in the settings file (or `--lora-modules`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=256)
    path: str = Field(min_length=1)
    tenants: tuple[str, ...] | None = None  # who may use it; None: every tenant


class Settings(BaseModel):
    """Every tunable of the server. Frozen: pass it down, never mutate it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Model and device.
    model: str = "smollm2-135m"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: bfloat16 on CUDA and on a CPU with AMX, else float32 (see gpu.models.cpu_has_native_bfloat16)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Weight-only quantization of every linear layer, the LM head included (see gpu/quantization.py);
    # "auto" keeps a GGUF model's own precision (the default model's Q4_1 serves in int4), else none.
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    # Which kernel the quantized layers multiply with, by a step's row count: auto times the packed
    # kernels against a dense copy of the same values at start (cached per machine) and keeps the copy
    # where it wins, for prompt chunks and large batches; auto-fbgemm: auto with int8 copies on fbgemm's
    # kernels among the candidates (not yet a win on the steps served: gpu/linear_kernels.py); packed:
    # the packed kernels alone, no copy.
    linear_kernels: Literal["auto", "auto-fbgemm", "packed"] = "auto"
    seed: int = 0
    # The runner's forward: eager, default (inductor), max (inductor with max-autotune and its C++
    # wrapper). Compiled at start-up; the artifacts are kept under compile_cache_dir (gpu/compiled.py).
    compile_mode: Literal["eager", "default", "max"] = "max"
    compile_cache_dir: str = "./data/compile_cache"
    # `fairlane serve` answers as soon as the weights are loaded, eagerly, while a child process compiles
    # the forward (gpu/background_compile.py); True: compile first, then serve (today's benchmarks do).
    compile_wait: bool = False
    # One graph for the whole step ("model"), or one decoder layer's graph shared by every layer ("layer":
    # regional compilation, a much shorter compile); auto: the faster step in the mode (docs/models.md).
    compile_scope: Literal["auto", "model", "layer"] = "auto"
    model_cache_dir: str = "./data/models"
    max_model_len: int | None = Field(default=None, ge=16)

    # LoRA adapters (vLLM's names): one base model, many adapters in one batch (gpu/lora.py, docs/lora.md).
    enable_lora: bool = False
    max_loras: int = Field(default=4, ge=1)  # adapter slots on the device
    max_cpu_loras: int | None = Field(default=None, ge=1)  # adapters kept read in CPU memory (LRU); None: 2 x max_loras
    max_lora_rank: int = Field(default=16, ge=1, le=512)
    lora_modules: tuple[str, ...] = ()  # NAME=PATH, each served from start-up to every tenant
    adapters: tuple[AdapterEntry, ...] = ()  # [[adapters]] tables: name, path and the tenants that may use it

    # KV cache and swap.
    block_size: int = Field(default=16, ge=1, le=256)
    # The KV pools' dtype (vLLM's --kv-cache-dtype): a 16-bit pool holds twice the tokens of a float32
    # one and a decode reads half the bytes; auto: see gpu/kv_cache.resolve_kv_cache_dtype.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_cache_bytes: int | None = Field(default=None, ge=1)  # None: kv_cache_memory_fraction of free memory
    # Of the memory available after the model loads (RAM on CPU, device memory on CUDA), when
    # kv_cache_bytes is not given; never more than max_num_seqs full-length sequences need.
    kv_cache_memory_fraction: float = Field(default=0.25, gt=0, le=0.95)
    swap_space_bytes: int = Field(default=512 * MiB, ge=0)
    # The prefix cache's lower tiers (docs/prefix-caching.md): blocks leaving the device pool are kept in host
    # memory (0: no host tier), and written through to files under kv_disk_cache_path (None: no disk tier),
    # which a restart finds again.
    kv_host_cache_bytes: int = Field(default=0, ge=0)
    kv_disk_cache_path: str | None = None
    kv_disk_cache_bytes: int = Field(default=8 * 1024 * MiB, ge=1)

    # Threads of torch's CPU kernels in this process (None: torch's default, one per core). Replicas that
    # share one machine's cores take a share each.
    torch_threads: int | None = Field(default=None, ge=1)

    # Scheduling.
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=512, ge=1)
    # A running prompt's chunk while other prompts of its class wait, as vLLM's flag: the rest of the step
    # starts them beside it (None: a quarter of max_num_batched_tokens; max_num_batched_tokens: none are).
    long_prefill_token_threshold: int | None = Field(default=None, ge=1)
    max_queued_requests: int = Field(default=1024, ge=1)  # requests in the engine, running or waiting
    # Batch-class work is shed first: once the queue holds this share of max_queued_requests (at least one
    # place), a batch request gets in only under its tenant's weighted share of that part; the rest of the
    # queue stays for interactive requests (scheduling/engine.py, EngineFront._check_room).
    batch_queue_fraction: float = Field(default=0.75, gt=0, le=1)
    # swap: a preempted batch request's KV goes to the CPU pool (recompute when it is full);
    # recompute: its KV is dropped and rebuilt on resume.
    preemption_mode: Literal["swap", "recompute"] = "swap"
    batch_min_share: float = Field(default=0.0, ge=0.0, le=1.0)  # of each step's tokens, kept for batch work
    # Step shaping: while interactive requests are active, a step holds only as much batch work as keeps its
    # predicted time within the interactive target (scheduling/step_shaper.py).
    step_shaping: bool = True
    # Speculative decoding (vLLM's --speculative-config, as JSON or a table; "none" or "off": off). On by
    # default: on the default model it never lost a level of `fairlane bench serve`, and the scheduler
    # verifies no proposal where the step cost model says it does not pay (docs/speculative-decoding.md).
    speculative_config: SpeculativeConfig | None = SpeculativeConfig(method="ngram", num_speculative_tokens=8)
    interactive_itl_target_ms: float | None = Field(default=None, gt=0)  # fixed; None: derived as below
    interactive_itl_slack: float = Field(default=1.1, ge=1.0)  # target = this x the interactive work's own time,
    interactive_itl_decodes: float = Field(default=2.0, ge=0.0)  # and at least this x a lone decode step's time,
    # and at least the interactive work's own time / (1 - this): the share of the streams' time batch work takes
    # on average beside them, in steps of its own (their median gap stays their own steps').
    interactive_batch_share: float = Field(default=0.55, ge=0.0, lt=1.0)
    # Another tenant's batch work beside a tenant's interactive requests: the streams' steps held to this x a lone
    # decode step (or the slack's target, if higher) on average, the room saved up and spent in steps of its own
    # (under a fixed target: in every step): one tenant's batch does not take another's streams to
    # interactive_itl_decodes (scheduling/step_shaper.py).
    interactive_itl_decodes_cross_tenant: float = Field(default=1.3, ge=0.0)
    # A step holding the batch work of the running tenant its batch queue has served least: other tenants
    # running more batch rows may lengthen it to this x its time so far, no more.
    served_less_step_slack: float = Field(default=1.3, ge=1.0)
    interactive_ttft_slack: float = Field(default=1.0, ge=1.0)  # a step with an interactive prompt: this x its time
    # While interactive requests may arrive (one was unfinished in the last arrival_window_s seconds; unset:
    # always), no step is predicted longer than the arrival budget, so an arriving request waits at most
    # about that long for its first step; unset, it is arrival_budget_decodes x a lone decode step's time.
    interactive_arrival_budget_ms: float | None = Field(default=None, gt=0)
    interactive_arrival_budget_decodes: float = Field(default=4.0, gt=0)
    interactive_arrival_window_s: float | None = Field(default=10.0, ge=0)
    # Batch work beside streams runs in steps of its own, once their saved-up room fills such a step: one up to
    # this many arrival budgets (a CPU's later rows in a step cost less than its first).
    interactive_saved_room_budgets: float = Field(default=1.5, ge=1.0)
    # While more than one tenant's interactive work is active or may arrive, the chunks of an interactive
    # prompt longer than this (and predicted past the arrival budget) are shaped: one tenant's long prompts
    # do not lengthen the steps another tenant's streams decode in.
    interactive_long_prompt_tokens: int = Field(default=256, ge=1)
    # While another tenant had unfinished work (any class) in the last long_prompt_chunk_window_s and
    # computes no long prompt of its own, a long interactive prompt is computed in chunks whose steps are
    # predicted within this many arrival budgets: that tenant's request arriving meanwhile waits for a
    # chunk, not the whole prompt.
    interactive_long_prompt_chunk_budgets: float = Field(default=4.0, ge=1.0)
    interactive_long_prompt_chunk_window_s: float = Field(default=60.0, ge=0)
    # After a step that ended an interactive request, wait up to this long for the client's next request
    # before planning the next step, so that it starts in that step (a closed-loop chat or agent sends it
    # within a few milliseconds of the last token); only while such waits catch requests, and within 5% of
    # the engine's time (scheduling/follow_up.py). 0: off.
    interactive_follow_up_wait_ms: float = Field(default=6.0, ge=0, le=100)
    enable_prefix_caching: bool = True
    queue_policy: Literal["vtc", "fcfs"] = "vtc"
    # Within each tenant's line under vtc (scheduling/queue_order.py): fcfs, hrrn (highest response ratio
    # next), srpt (shortest predicted work first) or lpm (longest cached prefix first). srpt with the FCFS
    # bound by `fairlane bench queue-order` and the mixed-length trace on the real server (docs/preemption.md).
    queue_order: Literal["fcfs", "hrrn", "srpt", "lpm"] = "srpt"
    # hrrn, srpt, lpm: a request goes first once its tenant's line has computed this many times the prompt
    # tokens FCFS would have computed by its first token (scheduling/fcfs_bound.py); 0: off.
    queue_fcfs_stretch: float = Field(default=1.3, ge=0)
    queue_aging_s: float = Field(default=300.0, gt=0)  # hrrn, srpt, lpm: a request waiting this long goes first
    vtc_prompt_weight: float = Field(default=1.0, gt=0)  # w_p, per prompt token computed
    vtc_decode_weight: float = Field(default=2.0, gt=0)  # w_q, per generated token
    cached_token_weight: float = Field(default=0.1, ge=0)  # share of w_p charged per cached prompt token
    # Cache breakpoints (cache_control): prompt tokens written to pinned blocks cost this times w_p, and each
    # tenant may have at most cache_pin_max_tokens pinned at once (past that a breakpoint is a plain prefix).
    cache_write_weight: float = Field(default=1.25, ge=1.0)
    cache_pin_max_tokens: int = Field(default=65536, ge=0)
    tenants_file: str | None = None

    # Files and Batch APIs.
    batch_db_path: str = "./data/fairlane.db"  # SQLite (WAL): files, batches and per-item results
    max_upload_bytes: int = Field(default=200 * MiB, ge=1024)
    # What each tenant may keep stored, unless its entry in the tenants file says otherwise (max_files,
    # max_file_bytes): without a bound, one tenant's uploads could fill the disk every tenant writes to.
    tenant_max_files: int = Field(default=1000, ge=1)
    tenant_max_file_bytes: int = Field(default=2 * 1024 * MiB, ge=1024)
    # Those quotas may add up to more than the disk holds: uploads also stop at each tenant's share (by
    # weight) of the disk's free space beyond this reserve, kept for work already accepted (batch results,
    # stored responses, the KV disk tier). A tenant past its share gets 507 for its own upload
    # (app/batch/disk_share.py).
    storage_reserve_bytes: int = Field(default=1024 * MiB, ge=0)
    # Each tenant's file uploads and downloads together move at most this many bytes a second: moving bytes
    # costs the CPU the model runs on (app/plumbing/byte_rate.py).
    tenant_file_bytes_per_s: int = Field(default=16 * MiB, ge=64 * 1024)
    # Stored responses (the Responses API's `store`, on by default) each tenant keeps: past either bound its
    # oldest finished ones go, as a cache's would. And its background responses queued or running at once:
    # each holds a task and, streamed, its event log in memory. The tenants file may say otherwise.
    tenant_max_stored_responses: int = Field(default=10_000, ge=1)
    tenant_max_stored_response_bytes: int = Field(default=1024 * MiB, ge=1024)
    tenant_max_background_responses: int = Field(default=64, ge=1)
    # Streams of background responses re-attached to (GET /v1/responses/{id}?stream=true) open at once, per
    # tenant: each holds a connection and costs no quota of the engine's.
    tenant_max_reattached_streams: int = Field(default=16, ge=1)
    # And re-attachments per minute, per tenant (None: no rate): one to a response that has ended replays
    # its whole event log at once, so a loop of them is cheap for the client and not for the server.
    tenant_reattaches_per_minute: int | None = Field(default=120, ge=1)
    # Past this many 429s a second to one tenant, its next 429s are answered after `refusal_pause_s`
    # (app/plumbing/rejection_pacing.py): a client looping on a limit takes the event loop and the CPU
    # from every other tenant. None: every 429 at once.
    tenant_refusals_per_s: float | None = Field(default=20.0, gt=0)
    refusal_pause_s: float = Field(default=1.0, gt=0, le=30)
    # Each tenant's heavy preparation (large bodies parsed, long texts tokenized, long conversations
    # rendered; app/serving/off_loop.py) takes at most this share of one core on average: after a job of
    # c CPU seconds, the tenant's next heavy job waits c * (1 / share - 1). 1: no wait.
    tenant_prepare_cpu_share: float = Field(default=0.1, gt=0, le=1)
    batch_window_s: int = Field(default=24 * 3600, ge=1)  # the "24h" completion window, in seconds
    batch_max_in_flight: int = Field(default=32, ge=1)  # batch items in the engine at once, all batches
    batch_poll_s: float = Field(default=1.0, gt=0)  # how often expiry is checked without other events

    # HTTP.
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=4 * MiB, ge=1024)
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    served_model_name: str | None = None
    default_max_tokens: int = Field(default=256, ge=1)  # when a request gives none (capped by the context left)
    stream_coalesce: bool = True  # a stream that fell behind sends its pending tokens as one SSE event
    # Tokens a stream sends at once after its first, as vLLM's --stream-interval: fewer wake-ups, SSE writes
    # and client reads per token, at the cost of smoothness. Interactive streams send each token as it comes;
    # batch-class ones (service_tier flex) hold up to 8, or half a second (scheduling/engine.py,
    # RequestStream). A request with stop strings is not held: the engine would compute the held tokens past
    # its stop before the API layer saw it.
    stream_interval: int = Field(default=1, ge=1)
    batch_stream_interval: int = Field(default=8, ge=1)
    http_header_timeout_s: float = Field(default=10.0, gt=0)  # a request head must arrive whole within this
    http_body_timeout_s: float = Field(default=30.0, gt=0)  # longest wait for the next piece of a body (408)
    max_connections: int = Field(default=2048, ge=1)  # open HTTP connections; more are refused (503)
    metrics_public: bool = False  # /metrics without the admin key (a scraper on a private network)

    # Observability.
    # fairlane: every metric family under the `fairlane:` prefix; vllm: each again under `vllm:`, so
    # dashboards written for vLLM work unedited (app/observability/metrics.py lists what matches vLLM's semantics).
    metrics_names: Literal["fairlane", "vllm"] = "fairlane"
    # OTLP over HTTP (protobuf), e.g. http://127.0.0.1:4318/v1/traces: one span tree per request.
    # None: no tracing, and opentelemetry is never imported (it is the optional `tracing` extra).
    otlp_traces_endpoint: str | None = Field(default=None, pattern=r"^https?://\S+$")

    # Engine health.
    engine_stall_s: float = Field(default=60.0, gt=0)  # work waiting and no step finished for this long: unhealthy

    # Replicas on Ray Serve (cluster/; `fairlane serve --replicas N`).
    replicas: int = Field(default=1, ge=1)  # engine replicas; more than one (or a ray_address) serves on Ray
    ray_address: str | None = None  # join this Ray cluster instead of starting a local instance
    # Which replica a request goes to: prefix_load (ours: the longest cached part of its salted block-hash
    # chain unless that replica is overloaded), pow2 (Ray Serve's default), prefix_affinity (Ray's LLM router).
    cluster_router: Literal["prefix_load", "pow2", "prefix_affinity"] = "prefix_load"
    router_max_imbalance: int = Field(default=4, ge=0)  # in-flight requests more than the least loaded: overloaded
    router_max_kv_use: float = Field(default=0.9, gt=0, le=1)  # KV share in use past which a replica is overloaded
    cluster_stats_period_s: float = Field(default=0.5, gt=0)  # how often replicas report load to the router
    share_vtc: bool = True  # fold the other replicas' service into each replica's VTC counters
    vtc_sync_interval_s: float = Field(default=0.1, gt=0)  # how often replicas exchange per-tenant service
    # Disaggregated serving (cluster/handoff.py): prompts on prefill replicas, decodes on decode replicas,
    # the prompt's KV handed over through files under kv_handoff_path (one folder per prefill replica, up to
    # kv_handoff_bytes each). Both 0: every replica does both (colocated, `replicas` of them).
    prefill_replicas: int = Field(default=0, ge=0)
    decode_replicas: int = Field(default=0, ge=0)
    kv_handoff_path: str | None = "./data/kv-handoff"
    kv_handoff_bytes: int = Field(default=2 * 1024 * MiB, ge=1)
    # A decode replica receives blocks into its prefix cache's host tier: this much when kv_host_cache_bytes
    # gives it none.
    kv_handoff_host_cache_bytes: int = Field(default=512 * MiB, ge=1)
    # Prompts shorter than this run whole on a decode replica (conditional disaggregation, as NVIDIA
    # Dynamo's router does): their prefill costs a decode step little, and queued behind long prompts on
    # a prefill replica their first token would wait (`fairlane bench cluster --disaggregated`).
    disaggregation_min_prompt_tokens: int = Field(default=512, ge=0)

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative_json(cls, value: Any) -> Any:
        """--speculative-config and FAIRLANE_SPECULATIVE_CONFIG give JSON text, or "none" / "off"."""
        if isinstance(value, str) and value.strip().lower() in ("none", "off", "null"):
            return None
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
        return value

    @model_validator(mode="after")
    def _check_budgets(self) -> Settings:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (each running sequence decodes)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras (a slot is loaded from the CPU copy)")
        for module in self.lora_modules:
            name, _, path = module.partition("=")
            if not name or not path:
                raise ValueError(f"lora_modules entry {module!r} must be NAME=PATH")
        if (self.lora_modules or self.adapters) and not self.enable_lora:
            raise ValueError("lora_modules and [[adapters]] need enable_lora")
        if self.kv_disk_cache_path is not None and not self.kv_host_cache_bytes:
            raise ValueError("kv_disk_cache_path needs kv_host_cache_bytes: blocks reach the disk through host memory")
        self._check_disaggregation()
        return self

    def _check_disaggregation(self) -> None:
        if bool(self.prefill_replicas) != bool(self.decode_replicas):
            raise ValueError("prefill_replicas and decode_replicas go together: at least one of each, or neither")
        if self.prefill_replicas and not self.enable_prefix_caching:
            raise ValueError("prefill_replicas needs enable_prefix_caching: the decode replica admits the handed-off "
                             "blocks as a prefix-cache hit")
        if self.prefill_replicas and self.kv_handoff_path is None:
            raise ValueError("prefill_replicas needs kv_handoff_path, a folder both roles reach")

    @property
    def is_disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def is_cluster(self) -> bool:
        """Whether serving runs on Ray (cluster/) rather than in this one process."""
        return self.replicas > 1 or self.ray_address is not None or self.is_disaggregated

    def for_role(self, role: str) -> Settings:
        """A replica's settings: a decode replica of a disaggregated cluster gets a host tier to receive into."""
        if role == "decode" and not self.kv_host_cache_bytes:
            return self.model_copy(update={"kv_host_cache_bytes": self.kv_handoff_host_cache_bytes})
        return self

    @property
    def cpu_lora_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else 2 * self.max_loras

    def start_adapters(self) -> tuple[AdapterEntry, ...]:
        """The adapters served from start-up: --lora-modules (every tenant), then the [[adapters]] tables."""
        from_flags = tuple(AdapterEntry(name=name, path=path)
                           for name, _, path in (module.partition("=") for module in self.lora_modules))
        return from_flags + self.adapters


def _coerce_env_value(raw: str) -> Any:
    """Environment values are strings; pydantic's lax mode converts them per field."""
    return None if raw.lower() in ("none", "null") else raw


def settings_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Collect `FAIRLANE_X_Y` variables as `x_y` keys. Unknown ones are rejected later by name."""
    found: dict[str, Any] = {}
    for name, raw in environ.items():
        if name.startswith(ENV_PREFIX):
            found[name[len(ENV_PREFIX) :].lower()] = _coerce_env_value(raw)
    return found


def settings_from_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return dict(tomllib.load(handle))
    except FileNotFoundError as exc:
        raise SettingsError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from exc


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        key = ".".join(str(loc) for loc in error["loc"]) or "settings"
        if error["type"] == "extra_forbidden":
            parts.append(f"unknown setting '{key}'")
        else:
            parts.append(f"setting '{key}': {error['msg']}")
    return "; ".join(parts)


def load_settings(
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build the settings from defaults, then the TOML file, then the environment, then overrides."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(settings_from_toml(config_file))
    merged.update(settings_from_env(os.environ if environ is None else environ))
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return Settings(**merged)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None
