"""The plain-data contract between the scheduler and the model runner.

Torch-free on purpose: the scheduler builds a `StepPlan`, the runner executes it and answers with
a `StepResult`. Both sides import only this module of each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A grammar the output must follow: the sampler masks every token that would leave it, and
    once the grammar is complete only the request's stop tokens remain."""

    kind: Literal["json_object", "json_schema", "regex"]
    spec: str = ""  # the JSON schema as JSON text (json_schema), the pattern (regex); "" for json_object
    # Whose entries of the grammar cache it compiles into and reads: its tenant's (or cache group's), so that
    # no tenant learns from a first compile's time, or its absence, which schemas another has sent.
    scope: str = ""


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request picks its next token."""

    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass kept; 1 keeps everything
    top_k: int = 0  # tokens kept by rank; 0 keeps everything
    min_p: float = 0.0  # drop tokens below min_p times the top token's probability; 0 keeps everything
    seed: int | None = None  # a per-request generator: same tokens whatever shares the batch
    # OpenAI's penalties over the output so far: logit -= presence * [count > 0] + frequency * count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' / vLLM's: a token seen in the prompt or output has its logit divided by this
    # when positive, multiplied when negative; 1 changes nothing.
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # before this many output tokens, the tokens of `min_tokens_banned` cannot be drawn
    min_tokens_banned: tuple[int, ...] = ()  # the request's stop tokens (EOS and stop_token_ids)
    # Log probabilities to report with each sampled token: None for none, k >= 0 for the sampled
    # token's plus the k most likely ones. They are the model's raw log-softmax, before any penalty.
    logprobs: int | None = None
    # The same for every prompt token after the first (completions' echo with logprobs): the
    # prompt is then computed whole, never taken from the prefix cache.
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # response_format and forced tool calls
    # Whether a sequence of this request may carry the request's tokens (needs_history, or prompt_logprobs):
    # derived once here, because the scheduler asks for every running request at every step.
    carries_tokens: bool = field(init=False, default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "carries_tokens", self.needs_history or self.prompt_logprobs is not None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_history(self) -> bool:
        """Whether the sampler needs the request's tokens so far (see ScheduledSequence)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)


BASE_MODEL_SLOT = -1  # a sequence of the base model: no LoRA adapter


@dataclass(slots=True, frozen=True)
class LoraRef:
    """A LoRA adapter as the runner reads it. `version` grows each time a name is (re)loaded, so an
    adapter loaded again from a changed folder is never taken for the copy a slot or the CPU cache holds."""

    name: str
    path: str
    version: int = 0

    @property
    def cache_key(self) -> str:
        """What the prefix-cache salt carries: two adapters, or two versions of one, never share KV."""
        return f"{self.name}@{self.version}:{self.path}"


@dataclass(slots=True)
class ScheduledSequence:
    """One request's share of a step: a prefill chunk, a resume chunk or a single decode token."""

    request_id: str
    token_ids: list[int]  # the tokens fed this step, at positions start_position onward
    start_position: int  # tokens before this one already have their K/V in the cache
    block_table: tuple[int, ...]  # device block ids covering positions [0, start_position + len(token_ids))
    needs_sample: bool  # True when this chunk reaches the end of the known tokens
    sampling: SamplingParams
    # Filled only when needs_sample and sampling.needs_history (penalties, min_tokens), or for the
    # prompt chunks of a request with prompt_logprobs: the request's prompt and its output so far,
    # copies the runner may keep.
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    lora_slot: int = BASE_MODEL_SLOT  # the device slot of the request's LoRA adapter (see StepPlan.lora_loads)
    # Speculative decoding: the last num_draft_tokens of token_ids are proposed tokens, not yet the
    # request's. The runner verifies them in this forward (a logits row per fed token from the first
    # proposal's position on) and answers with the tokens it accepted and one more (StepResult.verified).
    num_draft_tokens: int = 0
    # With a draft model (gpu/draft.py): after sampling this sequence the runner proposes up to this many
    # tokens for the request's next step (StepResult.proposals); the sequence then carries the request's
    # prompt and output so far (prompt_token_ids, output_token_ids), which the draft reads what it lacks of.
    num_proposals_wanted: int = 0


@dataclass(slots=True)
class TierCopies:
    """The copies one step's plan asks of the runner, made in this order before anything else of the step:
    device->host (blocks about to be reused), disk deletes, host->disk writes (queued, never waited for),
    disk->host reads, host->device copies up. A hash written in a step is never deleted in it, while one
    deleted may be written again: deletes go first."""

    offloads: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    disk_writes: list[tuple[int, bytes]] = field(default_factory=list)  # (host block, block hash)
    disk_deletes: list[bytes] = field(default_factory=list)
    disk_reads: list[tuple[bytes, int]] = field(default_factory=list)  # (block hash, host block)
    onloads: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.disk_writes or self.disk_deletes or self.disk_reads or self.onloads)


@dataclass(slots=True)
class StepPlan:
    """Everything the runner does in one step, in order: swap out, swap in, forward, sample."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    finished_request_ids: list[str] = field(default_factory=list)  # runner drops their state
    # (slot, adapter): LoRA adapters to put in device slots before the forward. A slot named here held
    # no adapter any sequence of this step uses, so overwriting it is safe.
    lora_loads: list[tuple[int, LoraRef]] = field(default_factory=list)
    # The prefix cache's lower tiers (host memory, disk): copies made before everything else of the step.
    tier_copies: TierCopies = field(default_factory=TierCopies)
    # Disaggregated serving (cluster/handoff.py): (block hashes, device blocks) of prompts whose last chunk
    # runs in this step, for the runner to publish to the KV hand-off store after the forward.
    publishes: list[tuple[tuple[bytes, ...], tuple[int, ...]]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not (self.sequences or self.swap_out or self.swap_in or self.finished_request_ids or self.lora_loads
                    or self.tier_copies)


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """The log probabilities reported with one sampled token (see SamplingParams.logprobs)."""

    token_id: int
    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...]  # the k most likely (token id, logprob), most likely first


@dataclass(slots=True)
class StepResult:
    """What one step produced."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # for requests that asked for them
    # For sequences with proposed tokens (ScheduledSequence.num_draft_tokens), instead of the two above:
    # request id -> the accepted proposals, then the token sampled after them (1 to drafts + 1 tokens), and
    # their log probabilities when the request asked for them.
    verified: dict[str, tuple[int, ...]] = field(default_factory=dict)
    verified_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    proposals: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the draft model's, for the next step

    def tokens_of(self, request_id: str) -> tuple[int, ...]:
        """The tokens a sampled sequence adds to its request: what its verification emitted, or its one
        sampled token (also for a sequence whose proposals an executor did not verify: all rejected)."""
        return self.verified.get(request_id) or (self.sampled_token_ids[request_id],)
    # request id -> (the prompt position of the first entry's token, one entry per prompt token the
    # step's chunk predicts), for requests with prompt_logprobs
    prompt_logprobs: dict[str, tuple[int, tuple[TokenLogprobs, ...]]] = field(default_factory=dict)
    forward_seconds: float = 0.0  # time inside the model forward (for forward_fraction)
    swap_seconds: float = 0.0  # time spent copying blocks between device and CPU
    recompilations: int = 0  # compilations of the forward this step caused after start-up (should stay 0)
    # The runner switched to another forward before this step (a background compilation was done): the
    # step times measured before it no longer predict the steps to come.
    forward_changed: bool = False
    # LoRA slots the runner could not load this step (the adapter's folder went bad since it was checked):
    # (slot, why). The slot is left empty; the scheduler ends that adapter's requests with the reason.
    failed_lora_loads: tuple[tuple[int, str], ...] = ()
    # Disk blocks of the prefix cache the runner could not keep: writes dropped or failed (found since the
    # last step) and reads that failed (this step's: the host blocks they were read into hold nothing).
    lost_disk_blocks: tuple[bytes, ...] = ()
    failed_disk_reads: tuple[bytes, ...] = ()


@dataclass(slots=True, frozen=True)
class CacheGeometry:
    """The shape of the KV memory, reported by the runner so the scheduler can count blocks."""

    num_device_blocks: int
    num_cpu_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    # The prefix cache's lower tiers (scheduling/cache_tiers.py); 0: no such tier.
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    disk_block_hashes: tuple[bytes, ...] = ()  # what the disk tier held at start, least recently written first
