"""An executor that costs nothing, to measure everything around the model: scheduler, engine loop,
HTTP and SSE. It satisfies `scheduling.executor.Executor`.

Each sequence that needs a sample gets the next byte of a fixed UTF-8 script, so with a byte-level
tokenizer the output is readable text with 2-, 3- and 4-byte characters split across tokens.
"""

from __future__ import annotations

from config.settings import Settings
from gpu.plan import CacheGeometry, StepPlan, StepResult
from gpu.tokenizer import ByteTokenizer
from scheduling.engine import Engine
from scheduling.scheduler import Scheduler

SCRIPT = "The quick brown fox jumps over the lazy dog. Déjà vu, naïve café; 你好，世界！🙂🚀\n".encode()


class InstantExecutor:
    def __init__(self, geometry: CacheGeometry, script: bytes = SCRIPT, end_token: int | None = None) -> None:
        self._geometry = geometry
        self._script = script
        self._end_token = end_token  # sampled once the script is out, if set; else the script repeats
        self._num_sampled: dict[str, int] = {}  # per request: where it is in the script

    @property
    def geometry(self) -> CacheGeometry:
        return self._geometry

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self._num_sampled.pop(request_id, None)
        sampled: dict[str, int] = {}
        for seq in plan.sequences:
            if seq.needs_sample:
                index = self._num_sampled.get(seq.request_id, 0)
                if self._end_token is not None and index >= len(self._script):
                    sampled[seq.request_id] = self._end_token
                else:
                    sampled[seq.request_id] = self._script[index % len(self._script)]
                self._num_sampled[seq.request_id] = index + 1
        return StepResult(sampled_token_ids=sampled)


def script_text(num_tokens: int, script: bytes = SCRIPT) -> str:
    """The text of an output of num_tokens byte tokens (the tail may be an incomplete character)."""
    repeated = script * (num_tokens // len(script) + 1)
    return repeated[:num_tokens].decode("utf-8", errors="replace")


INSTANT_KV_BYTES = 64 * 1024 * 1024


def instant_geometry(settings: Settings, max_model_len: int = 4096) -> CacheGeometry:
    """The KV geometry a runner would report for settings.kv_cache_bytes (64 MiB when unset: there is
    no real memory to size it from), at a nominal block size in bytes."""
    bytes_per_block = 1024
    kv_bytes = settings.kv_cache_bytes or INSTANT_KV_BYTES
    return CacheGeometry(num_device_blocks=kv_bytes // bytes_per_block, num_cpu_blocks=0,
                         block_size=settings.block_size, bytes_per_block=bytes_per_block,
                         max_model_len=max_model_len)


def build_instant_engine(settings: Settings, max_model_len: int = 4096) -> tuple[Engine, ByteTokenizer]:
    """An engine (not started) over an InstantExecutor, and the byte tokenizer its output is read with."""
    from app.engine_factory import scheduler_config_of

    executor = InstantExecutor(instant_geometry(settings, max_model_len))
    scheduler = Scheduler(scheduler_config_of(settings), executor.geometry)
    return Engine(scheduler, executor, max_queued_requests=settings.max_queued_requests), ByteTokenizer()
