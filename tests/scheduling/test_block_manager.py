"""The block pool reports "no room" without side effects and refuses to free a block twice."""

from __future__ import annotations

import pytest

from scheduling.block_manager import BlockPool


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
