"""The KV hand-off of disaggregated serving between two real engines on builtin:tiny (float32), in one
process, without Ray: a prefill engine computes the prompt and first token and publishes the prompt's
full blocks into a folder; a decode engine receives them into held host blocks and continues. The
output is the colocated engine's, token for token; a store miss is recomputed; salts keep tenants
apart; every block comes back on both sides. Then the ingress's side (cluster/remote_engine.py) on
handles that call the replicas' code in this process, with replicas lost at each point of the hand-off."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.observability.tracing import RequestTracer
from cluster.handoff import continuation, prefill_request, receive_blocks
from cluster.handoff_runner import block_reader, open_publisher
from cluster.remote_engine import ClusterEngine, RemoteExecutor
from cluster.replica_calls import ReplicaCalls
from cluster.wire import ReplicaCall, ended_event
from gpu.kv_handoff import FolderPublisher
from gpu.models import LoadedModel, load_model
from gpu.runner import ModelRunner, RunnerBudget, kv_shape_of
from scheduling.engine import Engine
from scheduling.prefix_cache import prompt_block_hashes
from scheduling.request import Request, RequestId, TokenEvent
from scheduling.scheduler import Scheduler, SchedulerConfig

BLOCK = 16
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("builtin:tiny")


@dataclass
class Roles:
    prefill: Engine
    decode: Engine
    colocated: Engine
    publisher: FolderPublisher
    read: Callable[..., tuple[list[bytes], list[bytes]]]


@pytest.fixture
async def roles(tiny: LoadedModel, tmp_path: Path) -> AsyncIterator[Roles]:
    shape = kv_shape_of(tiny, BLOCK)

    def engine(host_blocks: int = 0) -> tuple[Engine, ModelRunner]:
        budget = RunnerBudget(BLOCK, 48 * shape.bytes_per_block, 0,
                              host_cache_bytes=host_blocks * shape.bytes_per_block)
        runner = ModelRunner(tiny, budget)
        return Engine(Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256), runner.geometry),
                      runner), runner

    prefill, prefill_runner = engine()
    decode, decode_runner = engine(host_blocks=32)
    colocated, _ = engine()
    publisher = open_publisher(prefill_runner, tmp_path / "handoff", "prefill-1", 64 << 20)
    read = block_reader(decode_runner, tmp_path / "handoff")
    for each in (prefill, decode, colocated):
        await each.start()
    yield Roles(prefill, decode, colocated, publisher, read)
    for each in (prefill, decode, colocated):
        await each.shutdown()


def prompt(seed: int, length: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def request(request_id: str, tokens: list[int], salt: str = "alice") -> Request:
    return Request(RequestId(request_id), tokens, MAX_TOKENS, cache_salt=salt)


async def collect(engine: Engine, submitted: Request) -> tuple[list[int], TokenEvent]:
    out: list[int] = []
    last: TokenEvent | None = None
    async for event in engine.submit(submitted):
        out.extend(event.new_token_ids)
        last = event
    assert last is not None and last.is_final
    return out, last


@dataclass
class HandedOff:
    tokens: list[int]
    final: TokenEvent
    num_received: int
    num_missed: int


async def disaggregated(roles: Roles, original: Request, before_decode: Callable[[], None] = lambda: None
                        ) -> HandedOff:
    chain = prompt_block_hashes(original.prompt_token_ids, BLOCK, original.cache_salt)
    first, first_event = await collect(roles.prefill, prefill_request(original))
    assert first_event.finish_reason == "length" and len(first) == 1
    assert roles.publisher.wait_published(chain, timeout_s=10)
    before_decode()
    note = await receive_blocks(roles.decode, chain, roles.publisher.location, roles.read)
    rest, final = await collect(roles.decode, continuation(original, first))
    return HandedOff(first + rest, final, note.num_blocks, note.num_missed)


async def test_the_output_is_the_colocated_engines_and_the_prompts_blocks_are_hits(roles: Roles) -> None:
    for seed in range(3):
        tokens = prompt(seed)
        expected, _ = await collect(roles.colocated, request(f"c{seed}", tokens))
        handed = await disaggregated(roles, request(f"d{seed}", tokens))
        assert handed.tokens == expected
        full_blocks = len(tokens) // BLOCK
        assert handed.num_received == full_blocks and handed.num_missed == 0
        assert handed.final.num_cached_tokens == full_blocks * BLOCK  # the decode side computed only the rest
        assert handed.final.num_output_tokens == MAX_TOKENS


async def test_a_store_miss_is_recomputed_with_the_same_output(roles: Roles) -> None:
    tokens = prompt(7)
    expected, _ = await collect(roles.colocated, request("c", tokens))
    folder = Path(roles.publisher.location)

    def lose_the_files() -> None:
        for path in folder.rglob("*"):
            if path.is_file() and path.name != "key":
                path.unlink()

    handed = await disaggregated(roles, request("d", tokens), before_decode=lose_the_files)
    assert handed.tokens == expected
    assert handed.num_received == 0 and handed.num_missed == len(tokens) // BLOCK
    assert handed.final.num_cached_tokens == 0


async def test_another_tenants_salt_finds_nothing_of_the_first_ones(roles: Roles) -> None:
    tokens = prompt(11)
    await disaggregated(roles, request("a", tokens, salt="alice"))
    _, bob_first = await collect(roles.prefill, prefill_request(request("b", tokens, salt="bob")))
    assert bob_first.num_cached_tokens == 0  # alice's blocks on the prefill side are not bob's
    bob_chain = prompt_block_hashes(tokens, BLOCK, "bob")
    alice_chain = prompt_block_hashes(tokens, BLOCK, "alice")
    assert not set(bob_chain) & set(alice_chain)
    roles.publisher.wait_published(bob_chain, timeout_s=10)
    note = await receive_blocks(roles.decode, bob_chain, roles.publisher.location, roles.read)
    assert note.num_blocks == len(bob_chain)  # bob's own blocks, published for bob


async def test_every_block_comes_back_on_both_sides(roles: Roles) -> None:
    for seed in range(4):
        await disaggregated(roles, request(f"d{seed}", prompt(seed, length=70 + 20 * seed)))
    for engine in (roles.prefill, roles.decode):
        await engine.wait_idle(timeout=10)
        assert engine.snapshot.kv_blocks.used == 0
        assert not engine.scheduler.blocks.tiers or not engine.scheduler.blocks.tiers.host.held


async def test_held_host_blocks_are_neither_found_nor_evicted_until_released(roles: Roles) -> None:
    scheduler = roles.decode.scheduler
    tiers = scheduler.blocks.tiers
    assert tiers is not None
    chain = prompt_block_hashes(prompt(21), BLOCK, "alice")
    held = await roles.decode.hold_for_import(chain)
    assert [block_hash for block_hash, _ in held] == list(chain)
    assert tiers.find(list(chain)) == ([], [])  # held: not found
    for index in range(tiers.host.capacity):  # every other host block is turned over
        tiers.host.insert(bytes([index % 256, index // 256]) * 8)
    assert all(block_hash in tiers.host for block_hash, _ in held)
    roles.decode.release_imports([], [block_hash for block_hash, _ in held])
    await roles.decode.hold_for_import(())  # a step boundary: the release is applied
    assert not tiers.host.held and not any(block_hash in tiers.host for block_hash, _ in held)


# ---- the ingress's side: ClusterEngine on handles that call ReplicaCalls in this process ----------


class Responses:
    """A streaming call as Ray Serve's handle answers it, failing after `fail_after` items if set (the
    replica dies there)."""

    def __init__(self, items: AsyncIterator[Any], fail_after: int | None) -> None:
        self._items = items
        self._fail_after = fail_after
        self.closing: asyncio.Future[None] | None = None

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        count = 0
        async for item in self._items:
            if count == self._fail_after:
                await self._items.aclose()  # type: ignore[attr-defined]
                raise RuntimeError("the actor died unexpectedly")
            yield item
            count += 1

    def cancel(self) -> None:
        self.closing = asyncio.ensure_future(self._items.aclose())  # type: ignore[attr-defined]


class Handle:
    """Ray Serve's streaming handle of one deployment, on the ReplicaCalls of its replicas: a call goes
    to the first replica, or after a fault to the next (the router's live one); each call takes the next
    of `faults` (None: no fault)."""

    def __init__(self, replicas: list[ReplicaCalls], method: str, faults: list[int | None] | None = None) -> None:
        self._replicas = replicas
        self._method = method
        self.faults = list(faults or [])
        self.calls: list[ReplicaCall] = []

    def remote(self, call: ReplicaCall) -> Responses:
        self.calls.append(call)
        fail_after = self.faults.pop(0) if self.faults else None
        replica = self._replicas[min(len(self.calls), len(self._replicas)) - 1]
        return Responses(getattr(replica, self._method)(call), fail_after)


def ingress(roles: Roles, prefill_faults: list[int | None], decode_faults: list[int | None],
            min_handoff_prompt_tokens: int = 0) -> tuple[ClusterEngine, Handle, Handle, ReplicaCalls]:
    decode_calls = ReplicaCalls(roles.decode, "decode-1", read_blocks=roles.read)
    prefill = Handle([ReplicaCalls(roles.prefill, "prefill-1", publisher=roles.publisher)], "prefill", prefill_faults)
    decode = Handle([decode_calls, ReplicaCalls(roles.colocated, "decode-2")], "generate", decode_faults)
    engine = ClusterEngine(RemoteExecutor(roles.decode.geometry, lambda _: None), roles.decode.tenants, decode,
                           board=None, max_queued_requests=64, batch_queue_fraction=0.75, stall_after_s=60,
                           report_max_age_s=10, prefill=prefill, min_handoff_prompt_tokens=min_handoff_prompt_tokens)
    return engine, prefill, decode, decode_calls


async def through_the_ingress(engine: ClusterEngine, submitted: Request) -> tuple[list[int], list[TokenEvent]]:
    events = [event async for event in engine.submit(submitted)]
    return [token for event in events for token in event.new_token_ids], events


@pytest.mark.parametrize(("prefill_faults", "decode_faults", "received"), [
    ([], [], True),  # the hand-off as it should go
    ([0], [], False),  # the prefill replica lost before its first token: a decode replica takes it whole
    ([1], [], False),  # lost after its first token, before it said where the blocks are: recomputed
    ([], [4], True),  # the decode replica lost after a few tokens: another continues from them
], ids=["handed-off", "prefill-lost-first", "prefill-lost-after-first-token", "decode-lost-mid-way"])
async def test_the_ingress_ends_each_request_once_with_its_whole_output(
        roles: Roles, prefill_faults: list[int | None], decode_faults: list[int | None], received: bool) -> None:
    tokens = prompt(31)
    expected, _ = await collect(roles.colocated, request("c", tokens))
    engine, _, decode, decode_calls = ingress(roles, prefill_faults, decode_faults)

    out, events = await through_the_ingress(engine, request("d", tokens))

    assert out == expected
    assert [event.is_final for event in events].count(True) == 1 and events[-1].finish_reason == "length"
    assert events[-1].num_output_tokens == MAX_TOKENS and events[-1].num_cached_tokens == 0
    assert (decode_calls.handoff.blocks_received == len(tokens) // BLOCK) is received
    first_decode = decode.calls[0]
    assert first_decode.request.num_output_tokens == (0 if prefill_faults == [0] else 1)
    if decode_faults:  # the second decode replica continued from every token the first one delivered
        assert len(decode.calls) == 2 and decode.calls[1].request.num_output_tokens > 1
        assert decode.calls[1].handoff_location is None


async def test_a_prompt_shorter_than_the_threshold_runs_whole_on_a_decode_replica(roles: Roles) -> None:
    engine, prefill, decode, _ = ingress(roles, [], [], min_handoff_prompt_tokens=101)
    short, long = prompt(61, length=100), prompt(62, length=101)
    assert (await through_the_ingress(engine, request("short", short)))[0] == (await collect(
        roles.colocated, request("c-short", short)))[0]
    assert not prefill.calls and decode.calls[0].handoff_location is None
    await through_the_ingress(engine, request("long", long))
    assert len(prefill.calls) == 1 and decode.calls[1].handoff_location is not None


async def test_a_request_the_prefill_replica_ends_is_not_handed_off(roles: Roles) -> None:
    engine, prefill, decode, _ = ingress(roles, [], [])
    one_token = Request(RequestId("one"), prompt(41), 1, cache_salt="alice")
    out, events = await through_the_ingress(engine, one_token)
    assert len(out) == 1 and events[-1].finish_reason == "length"
    assert not prefill.calls and len(decode.calls) == 1  # nothing to hand over: one replica runs it whole


async def test_the_requests_trace_shows_the_handoffs_publish_and_fetch_time(roles: Roles) -> None:
    engine, _, _, _ = ingress(roles, [], [])
    exporter = InMemorySpanExporter()
    engine.observers.append(RequestTracer.exporting_to(exporter, "builtin:tiny", batched=False))
    await through_the_ingress(engine, request("traced", prompt(51)))
    spans = {span.name: span for span in exporter.get_finished_spans()}
    handoff = spans["kv_handoff"]
    attributes = handoff.attributes or {}
    publish_s = float(attributes["fairlane.kv_handoff.publish_s"])  # type: ignore[arg-type]
    fetch_s = float(attributes["fairlane.kv_handoff.fetch_s"])  # type: ignore[arg-type]
    assert publish_s >= 0 and fetch_s > 0  # the decode replica read every block of the prompt
    assert handoff.start_time == spans["decode"].start_time  # from the first token on
    assert handoff.end_time is not None and handoff.start_time is not None
    assert abs((handoff.end_time - handoff.start_time) / 1e9 - (publish_s + fetch_s)) < 1e-3


class Refusing:
    """A prefill replica that refuses every request (full, or stopping), as ReplicaCalls answers then."""

    async def prefill(self, call: ReplicaCall) -> AsyncIterator[list[TokenEvent]]:
        yield [ended_event(call.request, None, "error", "replica prefill-1 refused the request: full")]


async def test_a_request_its_prefill_replica_refuses_runs_whole_on_a_decode_replica(roles: Roles) -> None:
    engine, _, decode, _ = ingress(roles, [], [])
    engine._prefill = Handle([Refusing()], "prefill")  # type: ignore[list-item]
    tokens = prompt(71)
    out, events = await through_the_ingress(engine, request("refused", tokens))
    assert out == (await collect(roles.colocated, request("c", tokens)))[0]
    assert events[-1].finish_reason == "length" and decode.calls[0].request.num_output_tokens == 0
