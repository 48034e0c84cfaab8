"""The disk tier of the prefix cache: full KV blocks kept as files, one per block hash.

The scheduler keeps the index of which hashes are on disk and decides evictions; this store only
writes, reads and deletes files. Writes go through one background thread, so the step never waits
on the disk; reads are synchronous and verified, so a torn, corrupt or foreign file is removed and
reported as a miss, never served. A write may borrow the caller's memory instead of copying it (the
runner lends the host block it writes from): the writer copies it when its turn comes, and the caller
takes it back (`reclaim`) before writing over it, so a burst of evictions costs no copy on the step and
is never dropped for want of queue room.

Layout: root/<config digest>/ (0700) holds `key` (0600, 32 random bytes, made once) and one file
per block (0600) named by a keyed hash of the block hash, so that a listing of the folder tells
nothing about anyone's prompts. A file is a 64-byte header (magic, format version, config digest,
block hash, payload length, crc32 of the payload) and the block's raw bytes in its dtype.

One store per folder at a time: a second process on the same folder would remove the other's
temporary files at its scan and trim the other's blocks to its own capacity.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import struct
import threading
import zlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1

_MAGIC = b"FLKV"
# magic, format version, config digest, block hash, payload length, crc32 of the payload; padded to
# 64 bytes so that the payload read in place after it is aligned for any dtype.
_HEADER = struct.Struct("<4sI16s16sQI12x")
_HASH_NBYTES = 16
_KEY_NAME = "key"
_KEY_NBYTES = 32
_TEMP_SUFFIX = ".tmp"
_FOLDER_MODE = 0o700
_FILE_MODE = 0o600
# Every file of ours is a regular file we made: a link in the folder is foreign, never followed.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW


class _BadBlockFile(Exception):
    """A file that must not be served: torn, corrupt, foreign, or of another configuration."""


@dataclass(slots=True)
class DiskStoreStats:
    writes: int = 0  # block files written
    write_bytes: int = 0  # bytes of those files, headers included
    writes_dropped: int = 0  # writes never attempted: queue full, writes stopped, or store closed
    writes_lent: int = 0  # writes queued on the caller's memory rather than on a copy
    write_errors: int = 0  # writes that failed with an OSError (the first one stops writes)
    reads: int = 0  # blocks read and verified, from disk or from the write queue
    read_failures: int = 0  # reads that found no valid block; a bad file is removed
    removed_at_scan: int = 0  # files the start-up scan removed: invalid, temporary, or beyond capacity
    deletes: int = 0  # deletes carried out


@dataclass(slots=True, eq=False)
class _Op:
    """A queued write (`block` set) or delete (`block` None). A write's block is a private copy, or
    while `lent_slot` is set the caller's own memory, lent until the writer copies it or the caller
    reclaims it. A write dropped in the queue becomes a delete: its hash is reported lost, so the block
    is off the caller's index, and no file of it may stay."""

    block_hash: bytes
    block: torch.Tensor | None
    lent_slot: int | None = None


def config_digest(config: Mapping[str, str | int], block_shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
    """What makes a block valid, in 16 bytes: the caller's config, the payload's layout, the format."""
    described = {"config": dict(config), "block_shape": list(block_shape), "dtype": str(dtype),
                 "format_version": FORMAT_VERSION}
    return hashlib.blake2b(json.dumps(described, sort_keys=True).encode(), digest_size=16).digest()


def _create_root(root: Path) -> None:
    """Create root 0700 when missing. An existing root is left as it is (it may be a shared cache
    folder); privacy comes from the config folder below it, which is always 0700."""
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=_FOLDER_MODE, parents=True)
        os.chmod(root, _FOLDER_MODE)  # mkdir's mode is masked by the umask


def _write_private(path: Path, chunks: Sequence[bytes | memoryview]) -> None:
    fd = os.open(path, _WRITE_FLAGS, _FILE_MODE)
    with open(fd, "wb", closefd=True) as file:
        os.fchmod(fd, _FILE_MODE)  # open's mode is masked by the umask, and a file already there keeps its own
        for chunk in chunks:
            file.write(chunk)


def _write_file(final: Path, header: bytes, payload: memoryview) -> None:
    """Write a block file whole or not at all: a temporary file renamed into place. A crash leaves at
    most the temporary file, which the next scan removes. No fsync: surviving a power loss is not a
    goal, and a file torn by one fails its size or checksum check on read."""
    temp = final.with_name(final.name + _TEMP_SUFFIX)
    try:
        _write_private(temp, (header, payload))
        os.replace(temp, final)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _load_or_create_key(folder: Path) -> bytes:
    path = folder / _KEY_NAME
    with contextlib.suppress(FileNotFoundError):
        key = path.read_bytes()
        if len(key) == _KEY_NBYTES:
            return key
    # Missing or damaged: a new key renames every block, so the scan removes the old files as unmatched.
    key = secrets.token_bytes(_KEY_NBYTES)
    temp = folder / (_KEY_NAME + _TEMP_SUFFIX)
    _write_private(temp, (key,))
    os.replace(temp, path)
    return key


def _remove(path: str | Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _check_hash(block_hash: bytes) -> None:
    if len(block_hash) != _HASH_NBYTES:
        raise ValueError(f"a block hash is {_HASH_NBYTES} bytes, got {len(block_hash)}")


class BlockFiles:
    """One configuration's folder of block files: names keyed by its key, headers, and verified reads.
    The disk tier writes through it; a reader of another process's folder (the KV hand-off between
    replicas, cluster/handoff.py) only reads. Reads may come from any thread, one at a time."""

    def __init__(self, folder: Path, key: bytes, digest: bytes, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.folder = folder
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self._key = key
        self._digest = digest
        self.block_nbytes = math.prod(self.block_shape) * torch.empty((), dtype=dtype).element_size()
        self.file_nbytes = _HEADER.size + self.block_nbytes
        # One staging buffer for every read (header and payload in one `readinto`), viewed as the block.
        self._staging = torch.empty(self.file_nbytes, dtype=torch.uint8)
        self._staging_bytes = self._staging.numpy().data
        self._staged_block = self._staging[_HEADER.size:].view(dtype).view(self.block_shape)
        self._read_lock = threading.Lock()

    def path_of(self, block_hash: bytes) -> Path:
        """Where a block's file is (or would be): named by a keyed hash, so the name reveals nothing."""
        return self.folder / hashlib.blake2b(block_hash, key=self._key, digest_size=32).hexdigest()

    def header(self, block_hash: bytes, payload: memoryview) -> bytes:
        return _HEADER.pack(_MAGIC, FORMAT_VERSION, self._digest, block_hash, self.block_nbytes, zlib.crc32(payload))

    def check_header(self, header: bytes | memoryview, name: str) -> tuple[bytes, int]:
        """The header's block hash and payload checksum, if it belongs under this name in this folder."""
        magic, version, digest, block_hash, payload_nbytes, checksum = _HEADER.unpack_from(header)
        if magic != _MAGIC or version != FORMAT_VERSION:
            raise _BadBlockFile("not a block file of this format")
        if digest != self._digest or payload_nbytes != self.block_nbytes:
            raise _BadBlockFile("a block of another configuration")
        if self.path_of(block_hash).name != name:
            raise _BadBlockFile("a block under another block's name")
        return block_hash, checksum

    def read_into(self, block_hash: bytes, out: torch.Tensor) -> bool:
        """Copy the block's file into `out` once verified; False (and a bad file removed) otherwise."""
        with self._read_lock:
            try:
                self._read_file(block_hash)
            except (OSError, _BadBlockFile) as error:
                logger.debug("KV block file rejected: %s", error)
                _remove(self.path_of(block_hash))
                return False
            out.copy_(self._staged_block)
        return True

    def _read_file(self, block_hash: bytes) -> None:
        """Read and verify a block's file into the staging buffer."""
        path = self.path_of(block_hash)
        with open(os.open(path, _READ_FLAGS), "rb", buffering=0, closefd=True) as file:
            if os.fstat(file.fileno()).st_size != self.file_nbytes:
                raise _BadBlockFile("truncated or overlong")
            filled = 0
            while filled < self.file_nbytes:
                count = file.readinto(self._staging_bytes[filled:])
                if not count:
                    raise _BadBlockFile("short read")
                filled += count
        _, checksum = self.check_header(self._staging_bytes, path.name)
        if zlib.crc32(self._staging_bytes[_HEADER.size:]) != checksum:
            raise _BadBlockFile("payload checksum mismatch")


def open_block_files(root: str | Path, config: Mapping[str, str | int], block_shape: tuple[int, ...],
                     dtype: torch.dtype) -> BlockFiles | None:
    """A reader of the block files another store keeps under root for this configuration; None when that
    store has not made its folder (or key) yet. It never creates or trims anything."""
    digest = config_digest(config, tuple(block_shape), dtype)
    folder = Path(root) / digest.hex()
    try:
        key = (folder / _KEY_NAME).read_bytes()
    except OSError:
        return None
    if len(key) != _KEY_NBYTES:
        return None
    return BlockFiles(folder, key, digest, tuple(block_shape), dtype)


class DiskBlockStore:
    """Full KV blocks kept as files, one per block hash, in a folder private to this configuration.

    `write`, `delete` and `read_into` are meant for one caller thread (the runner's); `take_lost`,
    `flush` and the properties may be called from any thread."""

    def __init__(self, root: str | Path, config: Mapping[str, str | int], block_shape: tuple[int, ...],
                 dtype: torch.dtype, capacity_bytes: int, max_pending_bytes: int = 64 << 20) -> None:
        if capacity_bytes < 0 or max_pending_bytes < 0:
            raise ValueError("capacity_bytes and max_pending_bytes must not be negative")
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        digest = config_digest(config, self.block_shape, dtype)
        self.folder = self._open_folder(Path(root), digest)
        self.files = BlockFiles(self.folder, _load_or_create_key(self.folder), digest, self.block_shape, dtype)
        self._block_nbytes = self.files.block_nbytes
        self._file_nbytes = self.files.file_nbytes
        self._capacity_blocks = capacity_bytes // self._file_nbytes
        self._max_pending_bytes = max_pending_bytes
        self.stats = DiskStoreStats()
        self._stored = self._scan()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # the queue changed, or an operation finished
        self._queue: deque[_Op] = deque()
        # The last queued operation of each hash until it is done: what a read of that hash must see.
        # Empty exactly when nothing is queued or in progress.
        self._latest: dict[bytes, _Op] = {}
        self._pending_bytes = 0
        self._lent: dict[int, _Op] = {}  # queued writes still reading the caller's memory, by its slot
        self._lost: list[bytes] = []
        self._writes_enabled = True
        self._closing = False
        self._abandoned = False
        self._writer = threading.Thread(target=self._run_writer, name="kv-disk-writer", daemon=True)
        self._writer.start()

    @property
    def block_nbytes(self) -> int:
        """The payload size of one block."""
        return self._block_nbytes

    @property
    def capacity_blocks(self) -> int:
        """How many block files fit in capacity_bytes."""
        return self._capacity_blocks

    @property
    def writes_enabled(self) -> bool:
        """False for good once a write has failed (a full disk, an I/O error) or the store is closed."""
        return self._writes_enabled and not self._closing

    @property
    def pending_bytes(self) -> int:
        """Payload bytes of the private copies queued or being written (lent memory is the caller's)."""
        with self._lock:
            return self._pending_bytes

    def stored(self) -> list[bytes]:
        """The block hashes found valid by the start-up scan, least recently written first. Later
        writes and deletes are not reflected: the scheduler keeps that index."""
        return list(self._stored)

    def path_of(self, block_hash: bytes) -> Path:
        """Where a block's file is (or would be): named by a keyed hash, so the name reveals nothing."""
        return self.files.path_of(block_hash)

    def write(self, block_hash: bytes, block: torch.Tensor, lent_slot: int | None = None) -> None:
        """Queue a write of `block`. Never waits on the disk: a write that comes after writes stopped,
        or needs a copy that does not fit the queue, is dropped and its hash reported by `take_lost`.

        Without `lent_slot` the block is copied and the caller may reuse its memory at once. With it,
        the memory is lent under that number (a host block id, say): the writer copies it when it gets
        there, and the caller must `reclaim` the slot before writing over it."""
        _check_hash(block_hash)
        self._check_block(block)
        with self._lock:
            if lent_slot is not None and self._writes_open():
                assert lent_slot not in self._lent, f"slot {lent_slot} is lent already: reclaim it first"
                op = _Op(block_hash, block, lent_slot)
                self._lent[lent_slot] = op
                self.stats.writes_lent += 1
                self._enqueue(op)
                return
            if not self._can_queue_write():
                self._drop(block_hash)
                return
            self._pending_bytes += self._block_nbytes
            self._enqueue(_Op(block_hash, self._private_copy(block)))

    def reclaim(self, slots: Iterable[int]) -> None:
        """Take lent memory back before writing over it: a write still queued on one of these slots
        gets a private copy, or is dropped (and reported lost) when the queue has no room for one."""
        with self._lock:
            for slot in slots:
                op = self._lent.pop(slot, None)
                if op is None:
                    continue
                op.lent_slot = None
                if self._can_queue_write():
                    assert op.block is not None
                    op.block = self._private_copy(op.block)
                    self._pending_bytes += self._block_nbytes
                else:
                    op.block = None
                    self._drop(op.block_hash)

    def delete(self, block_hash: bytes) -> None:
        """Remove a block's file, after every write queued before (a delete after a write wins)."""
        _check_hash(block_hash)
        with self._lock:
            if not self._closing:
                self._enqueue(_Op(block_hash, None))
                return
        _remove(self.path_of(block_hash))  # closed: no writer to queue behind
        with self._lock:
            self.stats.deletes += 1

    def read_into(self, block_hash: bytes, out: torch.Tensor) -> bool:
        """Copy a stored block into `out` (any view of the block's shape and dtype, e.g. host_pool[:, :, i]).
        False when there is no valid block: a bad file is removed and counted, never raised about.
        `out` is written only on success. A block still in the write queue is read from there."""
        _check_hash(block_hash)
        self._check_block(out)
        with self._lock:
            queued = self._latest.get(block_hash)
        if queued is not None:
            return self._read_queued(queued, out)
        found = self.files.read_into(block_hash, out)
        self._count_read(ok=found)
        return found

    def take_lost(self) -> list[bytes]:
        """The hashes whose writes were dropped or failed since the last call."""
        with self._lock:
            lost, self._lost = self._lost, []
            return lost

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write and delete is done; False if the timeout came first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._latest, timeout_s)

    def wait_written(self, hashes: Iterable[bytes], timeout_s: float) -> bool:
        """Wait until the writes (and deletes) queued for these hashes are done; False at the timeout."""
        wanted = set(hashes)
        with self._changed:
            return self._changed.wait_for(lambda: wanted.isdisjoint(self._latest), timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued writes (up to the timeout) and stop the writer; idempotent. Writes still
        queued at the timeout are dropped and reported lost as the writer reaches them."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            with self._lock:
                self._abandoned = True

    # The start-up scan.

    def _open_folder(self, root: Path, digest: bytes) -> Path:
        _create_root(root)
        folder = root / digest.hex()
        folder.mkdir(mode=_FOLDER_MODE, exist_ok=True)
        os.chmod(folder, _FOLDER_MODE)
        return folder

    def _scan(self) -> list[bytes]:
        """Keep the valid files (newest up to capacity), remove everything else that is not ours to skip."""
        kept: list[tuple[int, str, bytes]] = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name == _KEY_NAME or entry.is_dir(follow_symlinks=False):
                    continue
                found = self._scan_file(entry.path, entry.name)
                if found is None:
                    self._remove_at_scan(entry.path)
                else:
                    kept.append((found[0], entry.name, found[1]))
        kept.sort()  # oldest first; the name only breaks ties of the clock's coarse ticks
        num_excess = max(0, len(kept) - self._capacity_blocks)
        for _, name, _ in kept[:num_excess]:
            self._remove_at_scan(self.folder / name)
        if self.stats.removed_at_scan:
            logger.info("disk KV cache %s: removed %d files at start-up", self.folder, self.stats.removed_at_scan)
        return [block_hash for _, _, block_hash in kept[num_excess:]]

    def _scan_file(self, path: str, name: str) -> tuple[int, bytes] | None:
        """(mtime, block hash) of a valid-looking file: only its header and size are checked here,
        the payload's checksum on read."""
        if name.endswith(_TEMP_SUFFIX):
            return None  # left by a crash mid-write
        try:
            fd = os.open(path, _READ_FLAGS)
            try:
                status = os.fstat(fd)
                header = os.read(fd, _HEADER.size)
            finally:
                os.close(fd)
            if status.st_size != self._file_nbytes or len(header) != _HEADER.size:
                raise _BadBlockFile("truncated or overlong")
            block_hash, _ = self.files.check_header(header, name)
        except (OSError, _BadBlockFile):
            return None
        return status.st_mtime_ns, block_hash

    def _remove_at_scan(self, path: str | Path) -> None:
        _remove(path)
        self.stats.removed_at_scan += 1

    # Reads.

    def _check_block(self, block: torch.Tensor) -> None:
        if tuple(block.shape) != self.block_shape or block.dtype != self.dtype:
            raise ValueError(f"expected a {self.dtype} block of shape {self.block_shape}, "
                             f"got {block.dtype} {tuple(block.shape)}")

    def _read_queued(self, queued: _Op, out: torch.Tensor) -> bool:
        # Lent memory is still the caller's (only the caller reclaims it), and a copy is never changed.
        block = queued.block
        if block is None:  # a delete is queued, or the write was dropped: the block is gone
            self._count_read(ok=False)
            return False
        out.copy_(block)
        self._count_read(ok=True)
        return True

    def _count_read(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.stats.reads += 1
            else:
                self.stats.read_failures += 1

    # The writer thread.

    def _writes_open(self) -> bool:
        return self._writes_enabled and not self._closing

    def _can_queue_write(self) -> bool:
        return self._writes_open() and self._pending_bytes + self._block_nbytes <= self._max_pending_bytes

    def _private_copy(self, block: torch.Tensor) -> torch.Tensor:
        copy = torch.empty(self.block_shape, dtype=self.dtype)
        copy.copy_(block)
        return copy

    def _drop(self, block_hash: bytes) -> None:
        self.stats.writes_dropped += 1
        self._lost.append(block_hash)

    def _enqueue(self, op: _Op) -> None:
        self._queue.append(op)
        self._latest[op.block_hash] = op
        self._changed.notify_all()

    def _run_writer(self) -> None:
        while (op := self._next_op()) is not None:
            if op.block is not None:
                self._write_block(op.block_hash, op.block)
            else:
                self._delete_file(op.block_hash)
            self._finish(op)

    def _next_op(self) -> _Op | None:
        """The next operation, its lent memory (if any) copied while the caller cannot write over it."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._queue) or self._closing)
            if not self._queue:
                return None
            op = self._queue.popleft()
            if op.lent_slot is not None:
                del self._lent[op.lent_slot]
                assert op.block is not None
                op.block, op.lent_slot = self._private_copy(op.block), None
                self._pending_bytes += self._block_nbytes
            return op

    def _finish(self, op: _Op) -> None:
        with self._changed:
            if op.block is not None:
                self._pending_bytes -= self._block_nbytes
            if self._latest.get(op.block_hash) is op:
                del self._latest[op.block_hash]
            self._changed.notify_all()

    def _delete_file(self, block_hash: bytes) -> None:
        # A file that stays (an I/O error) is out of the scheduler's index already; the next scan's
        # capacity trim accounts for it.
        _remove(self.path_of(block_hash))
        with self._lock:
            self.stats.deletes += 1

    def _write_block(self, block_hash: bytes, block: torch.Tensor) -> None:
        if not self._writes_enabled or self._abandoned:
            with self._lock:
                self._drop(block_hash)
            return
        payload = block.view(-1).view(torch.uint8).numpy().data
        header = self.files.header(block_hash, payload)
        try:
            _write_file(self.path_of(block_hash), header, payload)
        except OSError as error:
            self._stop_writes(block_hash, error)
            return
        with self._lock:
            self.stats.writes += 1
            self.stats.write_bytes += self._file_nbytes

    def _stop_writes(self, block_hash: bytes, error: OSError) -> None:
        """A failed write stops writes for good: a full or failing disk rarely recovers by itself, and
        retrying every block would cost the step I/O for nothing. Reads go on."""
        with self._lock:
            self.stats.write_errors += 1
            self._lost.append(block_hash)
            self._writes_enabled = False
        # Only this thread writes, and it writes no more: this runs once.
        logger.warning("disk KV cache %s: a write failed, writes stopped (reads go on): %s", self.folder, error)
