"""The block pool reports "no room" without side effects and refuses to free a block twice; the
manager answers questions without changing anything and allocates whole or not at all."""

from __future__ import annotations

import pytest

from scheduling.block_manager import BlockPool, KVBlockManager
from scheduling.request import PriorityClass
from tests.factories import make_request


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    pool = BlockPool(4)
    taken = pool.allocate(3)
    assert taken is not None and len(set(taken)) == 3
    assert pool.allocate(2) is None
    assert (pool.num_free, pool.num_used) == (1, 3)
    pool.free(taken)
    assert (pool.num_free, pool.num_used) == (4, 0)


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    taken = pool.allocate(1)
    assert taken is not None
    pool.free(taken)
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free(taken)


# ---- the manager: pure questions, then one change that succeeds whole or not at all ----------

BLOCK = 4


def finished_prefix(manager: KVBlockManager, prompt: list[int]) -> None:
    """Compute a request over `prompt`, register its full blocks, and free it: they stay cached."""
    first = make_request(prompt)
    assert manager.allocate(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    manager.cache_computed_blocks(first)
    manager.free(first.request_id)


def test_cached_prefix_is_a_pure_question() -> None:
    manager = KVBlockManager(num_device_blocks=8, num_cpu_blocks=0, block_size=BLOCK)
    prompt = list(range(13))
    finished_prefix(manager, prompt)
    later = make_request(prompt)
    free_before = manager.device.num_free

    first_answer, second_answer = manager.cached_prefix(later), manager.cached_prefix(later)

    assert len(first_answer) == 3 and first_answer == second_answer  # 12 of 13 tokens; the last is computed
    assert manager.device.num_free == free_before and manager.block_table(later.request_id) == ()


def test_allocation_that_does_not_fit_leaves_the_prefix_unshared() -> None:
    manager = KVBlockManager(num_device_blocks=5, num_cpu_blocks=0, block_size=BLOCK)
    prompt = list(range(13))
    finished_prefix(manager, prompt)  # 3 cached blocks, all in the free queue
    holder = make_request(4, tenant_id="other")
    assert manager.allocate(holder, 4)  # takes one block: 4 free, 3 of them the cached prefix
    later = make_request([*prompt, *range(100, 108)])  # 21 tokens: 3 cached blocks + 3 fresh
    prefix = manager.cached_prefix(later)
    assert len(prefix) == 3

    assert not manager.allocate(later, later.num_tokens - 12, prefix)

    assert manager.device.num_free == 4 and manager.block_table(later.request_id) == ()
    assert manager.device_blocks_held_by("default") == 0
    assert manager.cached_prefix(later) == prefix  # still cached, still free to be shared later


def test_allocation_shares_the_prefix_and_counts_blocks_per_tenant() -> None:
    manager = KVBlockManager(num_device_blocks=8, num_cpu_blocks=4, block_size=BLOCK)
    prompt = list(range(13))
    finished_prefix(manager, prompt)
    later = make_request(prompt, tenant_id="a")
    prefix = manager.cached_prefix(later)

    assert manager.allocate(later, 1, prefix)

    assert manager.block_table(later.request_id)[:3] == tuple(prefix)
    assert manager.device_blocks_held_by("a") == 4
    later.num_computed_tokens = 13
    pairs = manager.swap_out(later)
    assert pairs is not None and manager.device_blocks_held_by("a") == 0
    assert manager.num_cpu_blocks(later.request_id) == 4
    manager.free(later.request_id)
    assert (manager.device.num_free, manager.cpu.num_free) == (8, 4)


def test_blocks_held_are_counted_per_tenant_and_class() -> None:
    """The KV share rule of an interactive request counts only its tenant's interactive blocks."""
    manager = KVBlockManager(num_device_blocks=8, num_cpu_blocks=4, block_size=BLOCK)
    chat = make_request(2 * BLOCK, tenant_id="a", priority=PriorityClass.INTERACTIVE)
    batch = make_request(3 * BLOCK, tenant_id="a", priority=PriorityClass.BATCH)
    assert manager.allocate(chat, 2 * BLOCK) and manager.allocate(batch, 3 * BLOCK)
    held = {p: manager.device_blocks_held_by("a", p) for p in PriorityClass}
    assert held == {PriorityClass.INTERACTIVE: 2, PriorityClass.BATCH: 3}
    assert manager.device_blocks_held_by("a") == 5

    batch.num_computed_tokens = 3 * BLOCK
    assert manager.swap_out(batch) is not None
    assert (manager.device_blocks_held_by("a", PriorityClass.BATCH), manager.device_blocks_held_by("a")) == (0, 2)
    assert manager.swap_in(batch) is not None
    assert manager.device_blocks_held_by("a", PriorityClass.BATCH) == 3
