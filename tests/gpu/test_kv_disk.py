"""The disk tier's store: real files under tmp_path. The only stand-ins are a gate that holds the
writer thread (to fill its queue deterministically) and a write that fails as a full disk does."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu import kv_disk
from gpu.kv_disk import DiskBlockStore

LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM, POOL_BLOCKS = 2, 2, 4, 8, 6
BLOCK_SHAPE = (LAYERS, 2, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
CONFIG: dict[str, str | int] = {"model": "builtin:tiny", "quantization": "none", "block_size": BLOCK_SIZE}
WAIT_S = 10.0


def block_hash(number: int, salt: str = "tenant-a") -> bytes:
    return hashlib.blake2b(f"{salt}/{number}".encode(), digest_size=16).digest()


def make_store(root: Path, dtype: torch.dtype = torch.float32, capacity_blocks: int = 100,
               config: dict[str, str | int] | None = None, max_pending_bytes: int = 64 << 20) -> DiskBlockStore:
    file_nbytes = 64 + torch.empty(BLOCK_SHAPE, dtype=dtype).nbytes
    return DiskBlockStore(root, CONFIG if config is None else config, BLOCK_SHAPE, dtype,
                          capacity_bytes=capacity_blocks * file_nbytes, max_pending_bytes=max_pending_bytes)


def random_pool(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A pool `[layers, 2, blocks, kv_heads, block_size, head_dim]` of random bit patterns (NaNs included)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (LAYERS, 2, POOL_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    element_size = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (*shape[:-1], shape[-1] * element_size), dtype=torch.uint8, generator=generator)
    return bits.view(dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def write_all(store: DiskBlockStore, pool: torch.Tensor, numbers: list[int]) -> None:
    for number in numbers:
        store.write(block_hash(number), pool[:, :, number % POOL_BLOCKS])
    assert store.flush(WAIT_S)


def age_files(store: DiskBlockStore, numbers_oldest_first: list[int]) -> None:
    """Give the files distinct mtimes in this order: the clock's ticks are too coarse to rely on."""
    for age, number in enumerate(reversed(numbers_oldest_first)):
        mtime = 1_700_000_000 - 60 * age
        os.utime(store.path_of(block_hash(number)), (mtime, mtime))


def block_files(store: DiskBlockStore) -> set[str]:
    return {name for name in os.listdir(store.folder) if name != "key"}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskBlockStore]:
    opened = make_store(tmp_path / "cache")
    yield opened
    opened.close()


@pytest.fixture
def writer_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Holds the writer thread before each file write until set; the real write then happens."""
    gate = threading.Event()
    real_write = kv_disk._write_file

    def gated_write(final: Path, header: bytes, payload: memoryview) -> None:
        gate.wait(WAIT_S)
        real_write(final, header, payload)

    monkeypatch.setattr(kv_disk, "_write_file", gated_write)
    yield gate
    gate.set()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact_into_a_non_contiguous_view(tmp_path: Path, dtype: torch.dtype) -> None:
    store = make_store(tmp_path, dtype=dtype)
    source = random_pool(dtype, seed=1)
    expected = source[:, :, 2].clone()
    store.write(block_hash(2), source[:, :, 2])
    source.zero_()  # the caller reuses its memory at once: the store must have copied the block
    assert store.flush(WAIT_S)
    target = torch.zeros_like(source)
    assert store.read_into(block_hash(2), target[:, :, 4])
    assert torch.equal(bits(target[:, :, 4]), bits(expected))
    assert not target[:, :, 3].any() and not target[:, :, 5].any()  # neighbours untouched
    assert (store.stats.writes, store.stats.reads, store.stats.read_failures) == (1, 1, 0)
    store.close()


def test_a_read_of_a_queued_write_returns_its_bytes(store: DiskBlockStore, writer_gate: threading.Event) -> None:
    pool = random_pool(torch.float32)
    store.write(block_hash(1), pool[:, :, 1])
    target = torch.zeros_like(pool)
    assert store.read_into(block_hash(1), target[:, :, 0])
    assert torch.equal(bits(target[:, :, 0]), bits(pool[:, :, 1]))
    writer_gate.set()
    assert store.flush(WAIT_S)
    assert store.path_of(block_hash(1)).exists()


def test_a_restart_lists_the_stored_hashes_oldest_first(tmp_path: Path) -> None:
    pool = random_pool(torch.float32)
    first = make_store(tmp_path)
    write_all(first, pool, [0, 1, 2, 3])
    first.close()
    age_files(first, [2, 0, 3, 1])
    restarted = make_store(tmp_path)
    assert restarted.stored() == [block_hash(n) for n in (2, 0, 3, 1)]
    target = torch.zeros_like(pool)
    assert restarted.read_into(block_hash(3), target[:, :, 5])
    assert torch.equal(bits(target[:, :, 5]), bits(pool[:, :, 3]))
    assert restarted.stats.removed_at_scan == 0
    restarted.close()


@pytest.mark.parametrize(("config", "dtype"), [({**CONFIG, "model": "other"}, torch.float32),
                                               (CONFIG, torch.bfloat16),
                                               ({**CONFIG, "block_size": 8}, torch.float32)],
                         ids=["model", "dtype", "block_size"])
def test_another_configuration_ignores_the_files_and_leaves_them(tmp_path: Path, config: dict[str, str | int],
                                                                 dtype: torch.dtype) -> None:
    pool = random_pool(torch.float32)
    first = make_store(tmp_path)
    write_all(first, pool, [0, 1])
    first.close()
    other = make_store(tmp_path, dtype=dtype, config=config)
    assert other.folder != first.folder
    assert other.stored() == []
    assert not other.read_into(block_hash(0), torch.zeros(BLOCK_SHAPE, dtype=dtype))
    other.close()
    assert len(block_files(first)) == 2
    again = make_store(tmp_path)
    assert set(again.stored()) == {block_hash(0), block_hash(1)}
    again.close()


def test_the_scan_removes_torn_foreign_and_misplaced_files(tmp_path: Path) -> None:
    pool = random_pool(torch.float32)
    first = make_store(tmp_path)
    write_all(first, pool, [0, 1, 2, 3, 4])
    first.close()
    other = make_store(tmp_path, config={**CONFIG, "model": "other"})
    write_all(other, pool, [5])
    other.close()

    with open(first.path_of(block_hash(0)), "r+b") as torn:
        torn.truncate(100)
    (first.folder / "garbage").write_bytes(b"not a block")
    first.path_of(block_hash(1)).with_suffix(".tmp").write_bytes(b"half a write")
    # A valid file of another configuration, copied under a name that is valid here.
    first.path_of(block_hash(2)).write_bytes(other.path_of(block_hash(5)).read_bytes())
    # A valid file of this configuration under another block's name.
    os.replace(first.path_of(block_hash(3)), first.path_of(block_hash(6)))

    restarted = make_store(tmp_path)
    assert set(restarted.stored()) == {block_hash(1), block_hash(4)}
    assert restarted.stats.removed_at_scan == 5
    assert block_files(restarted) == {restarted.path_of(block_hash(n)).name for n in (1, 4)}
    assert other.path_of(block_hash(5)).exists()  # the other configuration's own file stays
    restarted.close()


def test_a_corrupt_payload_fails_its_read_and_the_file_is_removed(tmp_path: Path) -> None:
    pool = random_pool(torch.float32)
    first = make_store(tmp_path)
    write_all(first, pool, [0, 1])
    first.close()
    path = first.path_of(block_hash(0))
    with open(path, "r+b") as file:
        file.seek(64 + 1000)
        byte = file.read(1)
        file.seek(64 + 1000)
        file.write(bytes([byte[0] ^ 0x01]))

    restarted = make_store(tmp_path)
    assert set(restarted.stored()) == {block_hash(0), block_hash(1)}  # the scan reads headers only
    target = torch.zeros_like(pool)
    assert not restarted.read_into(block_hash(0), target[:, :, 0])
    assert not target.any()  # a failed read writes nothing into `out`
    assert not path.exists()
    assert restarted.stats.read_failures == 1
    assert restarted.read_into(block_hash(1), target[:, :, 1])
    restarted.close()


def test_a_file_torn_after_the_scan_fails_its_read_and_a_missing_one_too(store: DiskBlockStore) -> None:
    pool = random_pool(torch.float32)
    write_all(store, pool, [0])
    path = store.path_of(block_hash(0))
    with open(path, "r+b") as torn:
        torn.truncate(store.block_nbytes)
    target = torch.zeros_like(pool)
    assert not store.read_into(block_hash(0), target[:, :, 0])
    assert not path.exists()
    assert not store.read_into(block_hash(9), target[:, :, 0])
    assert store.stats.read_failures == 2
    assert not target.any()


def test_folders_are_0700_and_files_0600(tmp_path: Path) -> None:
    root = tmp_path / "nested" / "cache"
    previous_umask = os.umask(0o002)  # a lax umask: the modes must not depend on it
    try:
        store = make_store(root)
        write_all(store, random_pool(torch.float32), [0])
        store.close()
    finally:
        os.umask(previous_umask)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.folder / "key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(store.path_of(block_hash(0))).st_mode) == 0o600


def test_file_names_do_not_reveal_block_hashes(tmp_path: Path) -> None:
    numbers = list(range(5))
    first = make_store(tmp_path / "one")
    write_all(first, random_pool(torch.float32), numbers)
    first.close()
    names = block_files(first)
    assert len(names) == 5
    for number in numbers:
        hex_hash = block_hash(number).hex()
        assert all(hex_hash not in name and hex_hash[:8] not in name for name in names)
    # Keyed per folder: the same hash gets another name under another root.
    second = make_store(tmp_path / "two")
    assert second.path_of(block_hash(0)).name != first.path_of(block_hash(0)).name
    second.close()


def test_the_scan_trims_the_oldest_files_beyond_capacity(tmp_path: Path) -> None:
    first = make_store(tmp_path)
    write_all(first, random_pool(torch.float32), [0, 1, 2, 3, 4])
    first.close()
    age_files(first, [3, 1, 4, 0, 2])
    restarted = make_store(tmp_path, capacity_blocks=3)
    assert restarted.capacity_blocks == 3
    assert restarted.stored() == [block_hash(n) for n in (4, 0, 2)]
    assert restarted.stats.removed_at_scan == 2
    assert not restarted.path_of(block_hash(3)).exists() and not restarted.path_of(block_hash(1)).exists()
    restarted.close()


def test_writes_beyond_the_queue_are_dropped_and_reported_lost(tmp_path: Path, writer_gate: threading.Event) -> None:
    store = make_store(tmp_path, max_pending_bytes=2 * torch.empty(BLOCK_SHAPE).nbytes)
    pool = random_pool(torch.float32)
    for number in range(4):
        store.write(block_hash(number), pool[:, :, number])
    assert store.pending_bytes == 2 * store.block_nbytes
    assert store.take_lost() == [block_hash(2), block_hash(3)]
    assert store.take_lost() == []
    writer_gate.set()
    assert store.flush(WAIT_S)
    assert store.pending_bytes == 0
    assert block_files(store) == {store.path_of(block_hash(n)).name for n in (0, 1)}
    assert (store.stats.writes, store.stats.writes_dropped) == (2, 2)
    store.close()


def test_lent_writes_are_never_dropped_for_queue_room(tmp_path: Path, writer_gate: threading.Event) -> None:
    store = make_store(tmp_path, max_pending_bytes=0)  # no room at all for a copy
    pool = random_pool(torch.float32)
    expected = pool.clone()
    for number in range(POOL_BLOCKS):
        store.write(block_hash(number), pool[:, :, number], lent_slot=number)
    assert store.take_lost() == [] and store.pending_bytes == 0
    writer_gate.set()
    assert store.flush(WAIT_S)
    target = torch.zeros_like(pool)
    for number in range(POOL_BLOCKS):
        assert store.read_into(block_hash(number), target[:, :, number])
    assert torch.equal(bits(target), bits(expected))
    assert (store.stats.writes, store.stats.writes_lent, store.stats.writes_dropped) == (POOL_BLOCKS, POOL_BLOCKS, 0)
    store.close()


def test_a_reclaimed_slot_keeps_its_queued_write_as_it_was(tmp_path: Path, writer_gate: threading.Event) -> None:
    store = make_store(tmp_path)
    pool = random_pool(torch.float32)
    expected = pool[:, :, 1].clone()
    store.write(block_hash(1), pool[:, :, 1], lent_slot=1)
    store.reclaim([1, 3])  # 3 was never lent: nothing to do
    assert store.pending_bytes == store.block_nbytes
    pool[:, :, 1].zero_()  # the caller writes over its block
    target = torch.zeros_like(pool)
    assert store.read_into(block_hash(1), target[:, :, 0])  # from the queue: the copy, not the new bytes
    assert torch.equal(bits(target[:, :, 0]), bits(expected))
    writer_gate.set()
    assert store.flush(WAIT_S)
    restarted_target = torch.zeros_like(pool)
    assert store.read_into(block_hash(1), restarted_target[:, :, 5])  # from the file
    assert torch.equal(bits(restarted_target[:, :, 5]), bits(expected))
    store.write(block_hash(2), pool[:, :, 1], lent_slot=1)  # the slot may be lent again once reclaimed
    store.close()


def test_a_reclaim_with_no_room_for_a_copy_drops_the_write(tmp_path: Path, writer_gate: threading.Event) -> None:
    store = make_store(tmp_path, max_pending_bytes=0)
    pool = random_pool(torch.float32)
    store.write(block_hash(1), pool[:, :, 1], lent_slot=1)
    store.reclaim([1])
    pool[:, :, 1].zero_()
    assert store.take_lost() == [block_hash(1)]
    assert not store.read_into(block_hash(1), pool[:, :, 2])  # never the overwritten bytes
    writer_gate.set()
    assert store.flush(WAIT_S)
    assert not store.path_of(block_hash(1)).exists()
    assert (store.stats.writes, store.stats.writes_dropped) == (0, 1)
    store.close()


def test_a_write_error_logs_once_stops_writes_and_reads_go_on(
        store: DiskBlockStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pool = random_pool(torch.float32)
    write_all(store, pool, [0])

    def full_disk(final: Path, header: bytes, payload: memoryview) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(kv_disk, "_write_file", full_disk)
    caplog.set_level(logging.WARNING, logger="gpu.kv_disk")
    store.write(block_hash(1), pool[:, :, 1])
    store.write(block_hash(2), pool[:, :, 2])
    assert store.flush(WAIT_S)
    assert not store.writes_enabled
    assert store.take_lost() == [block_hash(1), block_hash(2)]
    store.write(block_hash(3), pool[:, :, 3])
    assert store.take_lost() == [block_hash(3)]  # at once, without waiting on the writer
    warnings = [record for record in caplog.records if record.name == "gpu.kv_disk"]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()
    assert store.stats.write_errors == 1
    target = torch.zeros_like(pool)
    assert store.read_into(block_hash(0), target[:, :, 0])
    assert torch.equal(bits(target[:, :, 0]), bits(pool[:, :, 0]))


def test_a_delete_after_a_write_removes_the_file(store: DiskBlockStore, writer_gate: threading.Event) -> None:
    pool = random_pool(torch.float32)
    store.write(block_hash(0), pool[:, :, 0])
    store.delete(block_hash(0))
    target = torch.zeros_like(pool)
    assert not store.read_into(block_hash(0), target[:, :, 0])  # the queued delete wins already
    writer_gate.set()
    assert store.flush(WAIT_S)
    assert not store.path_of(block_hash(0)).exists()
    assert not store.read_into(block_hash(0), target[:, :, 0])
    assert (store.stats.writes, store.stats.deletes) == (1, 1)
    assert not target.any()


def test_close_drains_the_queue_and_is_idempotent(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    pool = random_pool(torch.float32)
    numbers = list(range(POOL_BLOCKS))
    for number in numbers:
        store.write(block_hash(number), pool[:, :, number])
    store.close()
    store.close()
    assert store.pending_bytes == 0
    assert block_files(store) == {store.path_of(block_hash(n)).name for n in numbers}
    store.write(block_hash(9), pool[:, :, 0])
    assert store.take_lost() == [block_hash(9)]
    store.delete(block_hash(0))  # after close a delete is done at once
    assert not store.path_of(block_hash(0)).exists()
    restarted = make_store(tmp_path)
    assert set(restarted.stored()) == {block_hash(n) for n in numbers[1:]}
    restarted.close()
