"""The router's decisions, without Ray: the longest cached prefix unless overloaded, then least loaded."""

from __future__ import annotations

from cluster.routing import LoadLimits, PrefixMemory, ReplicaLoad, rank_replicas
from cluster.wire import replica_call
from scheduling.request import Request, RequestId

LIMITS = LoadLimits(max_imbalance=2, max_kv_use=0.9)


def chain(*blocks: int) -> list[bytes]:
    return [bytes([b]) for b in blocks]


def test_the_replica_holding_the_longest_prefix_comes_first() -> None:
    ranked = rank_replicas(["a", "b", "c"], {"a": 1, "b": 3}, {"a": ReplicaLoad(0), "b": ReplicaLoad(1)}, LIMITS)

    assert ranked[0] == "b"


def test_an_overloaded_replica_loses_its_prefix_to_the_least_loaded() -> None:
    loads = {"a": ReplicaLoad(0), "b": ReplicaLoad(3)}

    assert rank_replicas(["a", "b"], {"b": 5}, loads, LIMITS) == ["a", "b"]
    assert rank_replicas(["a", "b"], {"b": 5}, {"a": ReplicaLoad(0), "b": ReplicaLoad(0, kv_use=0.95)},
                         LIMITS)[0] == "a"


def test_without_any_cached_prefix_the_least_loaded_comes_first() -> None:
    loads = {"a": ReplicaLoad(4), "b": ReplicaLoad(1), "c": ReplicaLoad(2)}

    assert rank_replicas(["a", "b", "c"], {}, loads, LIMITS) == ["b", "c", "a"]


def test_memory_matches_leading_blocks_only_and_forgets_the_oldest() -> None:
    memory = PrefixMemory()
    memory.set_capacity("a", 3)
    memory.record("a", chain(1, 2, 3))

    assert memory.matched_blocks("a", chain(1, 2, 9)) == 2
    assert memory.matched_blocks("a", chain(9, 2, 3)) == 0
    memory.record("a", chain(4))
    assert memory.matched_blocks("a", chain(1, 2)) == 0  # block 1 was the least recently used
    memory.keep_only(["b"])
    assert memory.matched_blocks("a", chain(4)) == 0


def test_the_routing_chain_is_salted_like_the_cache() -> None:
    prompt = list(range(40))
    alice = replica_call(Request(RequestId("1"), prompt, 4, cache_salt="alice"), block_size=16)
    bob = replica_call(Request(RequestId("2"), prompt, 4, cache_salt="bob"), block_size=16)

    assert len(alice.block_hashes) == 2  # full blocks only
    assert not set(alice.block_hashes) & set(bob.block_hashes)
    assert alice.prompt == "".join(map(chr, prompt))
