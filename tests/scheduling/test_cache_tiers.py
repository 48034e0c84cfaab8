"""The prefix cache's lower tiers, as the scheduler plans them: blocks leaving the device are written down,
found again below it, copied up before the forward, and read from disk a step ahead. A fake runner keeps
each block's tokens as its contents and makes the plan's copies in the runner's order; every sequence
is checked to read the right tokens from its blocks, so a copy planned wrong fails the test."""

from __future__ import annotations

import random

from contract.plan import CacheGeometry, StepPlan, StepResult
from scheduling.cache_pins import CachePins
from scheduling.cache_tiers import LowerTiers
from scheduling.scheduler import Scheduler, SchedulerConfig
from tests.factories import make_request

BLOCK = 4


class ContentExecutor:
    """Blocks hold the tokens written into them; copies move them. Checks every read of the KV."""

    def __init__(self, geometry: CacheGeometry, fail_reads: set[bytes] | None = None) -> None:
        self.geometry = geometry
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}
        self.disk: dict[bytes, list[int | None]] = {}
        self.tokens: dict[str, list[int]] = {}  # each request's true tokens, told by the test
        self.fail_reads = fail_reads or set()
        self.copied_up = 0

    def execute(self, plan: StepPlan) -> StepResult:
        copies = plan.tier_copies
        for device_block, host_block in copies.offloads:
            self.host[host_block] = list(self._block(self.device, device_block))
        for block_hash in copies.disk_deletes:
            del self.disk[block_hash]
        for host_block, block_hash in copies.disk_writes:
            self.disk[block_hash] = list(self.host[host_block])
        failed = []
        for block_hash, host_block in copies.disk_reads:
            if block_hash in self.fail_reads:
                self.host[host_block] = [None] * BLOCK  # what a failed read leaves: garbage
                failed.append(block_hash)
            else:
                self.host[host_block] = list(self.disk[block_hash])
        for host_block, device_block in copies.onloads:
            self.device[device_block] = list(self.host[host_block])
            self.copied_up += 1
        sampled = {}
        for seq in plan.sequences:
            truth = self.tokens[seq.request_id]
            for position in range(seq.start_position):  # the KV the step reads
                block = self._block(self.device, seq.block_table[position // BLOCK])
                assert block[position % BLOCK] == truth[position], (seq.request_id, position)
            for offset, token in enumerate(seq.token_ids):
                position = seq.start_position + offset
                self._block(self.device, seq.block_table[position // BLOCK])[position % BLOCK] = token
            if seq.needs_sample:
                sampled[seq.request_id] = 7
                truth.append(7)
        return StepResult(sampled_token_ids=sampled, failed_disk_reads=tuple(failed))

    @staticmethod
    def _block(pool: dict[int, list[int | None]], block: int) -> list[int | None]:
        return pool.setdefault(block, [None] * BLOCK)


def geometry(num_device_blocks: int, num_host_blocks: int, num_disk_blocks: int = 0,
             disk_hashes: tuple[bytes, ...] = ()) -> CacheGeometry:
    return CacheGeometry(num_device_blocks, 0, BLOCK, 1024, 4096, num_host_blocks, num_disk_blocks, disk_hashes)


def serve(scheduler: Scheduler, executor: ContentExecutor, prompt: list[int], tenant: str = "default",
          max_tokens: int = 2) -> int:
    """One request to the end; its cached tokens."""
    request = make_request(list(prompt), max_tokens=max_tokens, tenant_id=tenant)
    request.cache_salt = tenant  # as the engine salts each tenant's requests
    executor.tokens[request.request_id] = list(prompt)
    scheduler.add_request(request)
    for _ in range(200):
        if not scheduler.has_work():
            return request.num_cached_tokens
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))
    raise AssertionError("the request did not finish")


def prompt_of(seed: int, length: int = 33) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]


def test_a_prefix_evicted_from_the_device_is_copied_up_from_host_memory() -> None:
    scheduler = Scheduler(SchedulerConfig(), geometry(num_device_blocks=12, num_host_blocks=64))
    executor = ContentExecutor(scheduler.geometry)
    first = prompt_of(1)
    assert serve(scheduler, executor, first) == 0
    for seed in range(2, 6):  # other prompts push the first one's blocks off the device
        serve(scheduler, executor, prompt_of(seed))
    assert scheduler.blocks.tiers is not None and scheduler.blocks.tiers.host.counters.writes >= 8

    assert serve(scheduler, executor, first) == 32  # all 8 full blocks but the last token's
    assert executor.copied_up >= 8
    assert scheduler.blocks.tiers is not None and scheduler.blocks.tiers.host.counters.hits >= 8


def test_a_prefix_only_on_disk_is_read_a_step_ahead_then_copied_up() -> None:
    scheduler = Scheduler(SchedulerConfig(), geometry(num_device_blocks=12, num_host_blocks=10, num_disk_blocks=100))
    executor = ContentExecutor(scheduler.geometry)
    first = prompt_of(1)
    serve(scheduler, executor, first)
    for seed in range(2, 8):  # off the device and out of the small host tier, still on disk
        serve(scheduler, executor, prompt_of(seed))
    tiers = scheduler.blocks.tiers
    assert tiers is not None and len(tiers.disk) > 8

    assert serve(scheduler, executor, first) == 32
    assert tiers.disk.counters.hits >= 1


def test_a_failed_disk_read_is_a_shorter_hit_recomputed() -> None:
    scheduler = Scheduler(SchedulerConfig(), geometry(num_device_blocks=12, num_host_blocks=10, num_disk_blocks=100))
    executor = ContentExecutor(scheduler.geometry)
    first = prompt_of(1)
    serve(scheduler, executor, first)
    for seed in range(2, 8):
        serve(scheduler, executor, prompt_of(seed))
    tiers = scheduler.blocks.tiers
    assert tiers is not None
    executor.fail_reads = set(tiers.disk.hashes())  # every file is unreadable now

    cached = serve(scheduler, executor, first)  # the executor checks it never reads a failed block

    assert cached < 32
    assert tiers.disk.counters.lost > 0


def test_a_restart_finds_the_disk_blocks_of_the_last_run() -> None:
    before = Scheduler(SchedulerConfig(), geometry(num_device_blocks=12, num_host_blocks=10, num_disk_blocks=100))
    executor = ContentExecutor(before.geometry)
    first = prompt_of(1)
    serve(before, executor, first)
    for seed in range(2, 8):
        serve(before, executor, prompt_of(seed))
    assert before.blocks.tiers is not None
    on_disk = tuple(before.blocks.tiers.disk.hashes())

    after = Scheduler(SchedulerConfig(), geometry(12, 10, 100, on_disk))
    restarted = ContentExecutor(after.geometry)
    restarted.disk = executor.disk  # the files; host memory and the device start empty

    assert serve(after, restarted, first) == 32


def test_two_tenants_never_share_blocks_in_any_tier() -> None:
    scheduler = Scheduler(SchedulerConfig(), geometry(num_device_blocks=12, num_host_blocks=64, num_disk_blocks=100))
    executor = ContentExecutor(scheduler.geometry)
    first = prompt_of(1)
    serve(scheduler, executor, first, tenant="a")
    for seed in range(2, 6):
        serve(scheduler, executor, prompt_of(seed), tenant="a")

    assert serve(scheduler, executor, first, tenant="b") == 0
    assert serve(scheduler, executor, first, tenant="a") == 32


def test_busy_and_pinned_entries_are_not_evicted() -> None:
    now = [0.0]
    pins = CachePins(max_blocks_per_tenant=8, clock=lambda: now[0])
    tiers = LowerTiers(num_host_blocks=2, num_disk_blocks=0, pin_owner=pins.owner_of)
    tiers.write_down(0, b"a")
    tiers.write_down(1, b"b")
    tiers.write_down(2, b"c")  # both entries are busy this step: c is not kept
    assert tiers.host.hashes() == [b"a", b"b"] and len(tiers.take_copies().offloads) == 2

    pins.pin("t", [b"a"], ttl_s=10.0)
    now[0] = 5.0
    tiers.write_down(2, b"c")  # a is pinned: b goes
    assert tiers.host.hashes() == [b"a", b"c"]
    tiers.take_copies()
    now[0] = 11.0
    tiers.write_down(3, b"d")  # a's pin is over: a goes
    assert tiers.host.hashes() == [b"c", b"d"]


def test_one_tenants_pins_keep_at_most_its_share_of_a_tier() -> None:
    """A quarter of the tier per tenant, half for all pins: the rest is always there for every tenant's
    evicted blocks, however much the pinning tenants may pin."""
    pins = CachePins(max_blocks_per_tenant=100, clock=lambda: 0.0)
    tiers = LowerTiers(num_host_blocks=8, num_disk_blocks=0, pin_owner=pins.owner_of)
    mallory = [b"m%d" % number for number in range(8)]
    for block, block_hash in enumerate(mallory):
        tiers.write_down(block, block_hash)
        tiers.take_copies()
    pins.pin("mallory", mallory, ttl_s=60)
    assert pins.pinned_by("mallory") == 8  # all of the host tier

    others = [b"o%d" % number for number in range(6)]
    for block, block_hash in enumerate(others):
        tiers.write_down(block, block_hash)
        tiers.take_copies()
    host = tiers.host.hashes()
    assert sum(block_hash in host for block_hash in mallory) == 2  # a quarter of 8
    assert all(block_hash in host for block_hash in others)

    pins.pin("trent", others[:4], ttl_s=60)  # a second pinning tenant: together, half of the tier
    for block, block_hash in enumerate([b"x%d" % number for number in range(8)]):
        tiers.write_down(block, block_hash)
        tiers.take_copies()
    kept = [block_hash for block_hash in tiers.host.hashes() if pins.owner_of(block_hash) is not None]
    assert len(kept) == 4 and sum(block_hash.startswith(b"o") for block_hash in kept) == 2


def test_pins_keep_to_the_tenant_quota_and_expire() -> None:
    now = [0.0]
    pins = CachePins(max_blocks_per_tenant=2, clock=lambda: now[0])
    assert pins.pin("a", [b"1", b"2", b"3"], ttl_s=60) == 2  # the third is past a's quota
    assert pins.pin("b", [b"4"], ttl_s=300) == 1  # b's quota is its own
    assert pins.is_pinned(b"2") and not pins.is_pinned(b"3")
    now[0] = 61.0
    pins.expire()
    assert not pins.is_pinned(b"1") and pins.pinned_by("a") == 0 and pins.is_pinned(b"4")


def test_a_pinned_prefix_survives_a_flood_for_its_ttl_then_goes() -> None:
    now = [0.0]
    scheduler = Scheduler(SchedulerConfig(), geometry(num_device_blocks=24, num_host_blocks=0), clock=lambda: now[0])
    executor = ContentExecutor(scheduler.geometry)
    pinned = prompt_of(1)
    request = make_request(list(pinned), max_tokens=2)
    request.cache_pin_tokens, request.cache_pin_ttl_s, request.cache_salt = 32, 300.0, "default"
    executor.tokens[request.request_id] = list(pinned)
    scheduler.add_request(request)
    while scheduler.has_work():
        plan = scheduler.schedule()
        scheduler.update(plan, executor.execute(plan))
    assert scheduler.pins.pinned_by("default") == 8

    for seed in range(2, 12):  # ten other prefixes through a pool that holds fewer than three
        now[0] += 10.0
        serve(scheduler, executor, prompt_of(seed))
    assert serve(scheduler, executor, pinned) == 32  # a hit, which renews the pin

    now[0] += 301.0
    for seed in range(12, 22):
        serve(scheduler, executor, prompt_of(seed))
    assert serve(scheduler, executor, pinned) == 0
    assert scheduler.pins.pinned_by("default") == 0  # past its TTL the pin is forgotten, quota and all
