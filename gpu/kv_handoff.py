"""The KV hand-off of disaggregated serving: a prefill replica publishes a prompt's full blocks, a decode
replica reads them into its host tier and admits the request with them as a prefix-cache hit.

Two small interfaces, so that another transport (Ray's object store, NIXL or LMCache where installed)
can carry blocks between machines: a publisher on the prefill side (`publish` from the runner's thread
right after the forward that wrote the blocks, `wait_published` from any thread) and a receiver on the
decode side (`read_into` a host block). The first transport is a folder both replicas reach: each prefill
replica writes block files in the disk tier's format (gpu/kv_disk.py: names keyed by a key of its own,
headers naming the configuration, checksums) into a folder of its own, and names that folder (the
"location") in its answer. The decode replica only reads, verified: a block it cannot read is recomputed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from gpu.kv_disk import BlockFiles, DiskBlockStore, open_block_files


class KVPublisher(Protocol):
    location: str  # what a receiver needs to find what this publisher published

    def publish(self, blocks: Sequence[tuple[bytes, torch.Tensor]]) -> None:
        """Queue (block hash, block) pairs; returns before they are written. The runner's thread only."""

    def wait_published(self, hashes: Sequence[bytes], timeout_s: float) -> bool:
        """Wait until these blocks can be received; False if some cannot (dropped, failed, timed out)."""

    def close(self) -> None:
        """Finish what is queued; publish nothing more."""


class KVReceiver(Protocol):
    def read_into(self, location: str, block_hash: bytes, out: torch.Tensor) -> bool:
        """Copy a published block into `out`; False (and `out` untouched) when it cannot be read."""


class FolderPublisher:
    """Publishes into a disk-tier store of its own, keeping its newest blocks up to the store's capacity:
    a block published again is kept longer, the oldest are deleted past capacity."""

    def __init__(self, store: DiskBlockStore) -> None:
        self._store = store
        self.location = str(store.folder.parent)  # the root the store made its configuration's folder in
        self._published: OrderedDict[bytes, None] = OrderedDict()

    def publish(self, blocks: Sequence[tuple[bytes, torch.Tensor]]) -> None:
        for lost in self._store.take_lost():  # dropped or failed writes: write them again when asked
            self._published.pop(lost, None)
        for block_hash, block in blocks:
            if block_hash in self._published:
                self._published.move_to_end(block_hash)
                continue
            self._store.write(block_hash, block)
            self._published[block_hash] = None
        while len(self._published) > self._store.capacity_blocks:
            oldest, _ = self._published.popitem(last=False)
            self._store.delete(oldest)

    def wait_published(self, hashes: Sequence[bytes], timeout_s: float) -> bool:
        if not self._store.wait_written(hashes, timeout_s):
            return False
        return all(self._store.path_of(block_hash).is_file() for block_hash in hashes)

    def close(self) -> None:
        self._store.close()


class FolderReceiver:
    """Reads what folder publishers under one root published: a location outside that root is refused
    (it comes over the wire), and a folder whose publisher has not started yet is looked for again later."""

    def __init__(self, root: str | Path, config: Mapping[str, str | int], block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self._root = Path(root).resolve()
        self._config = dict(config)
        self._block_shape = tuple(block_shape)
        self._dtype = dtype
        self._folders: dict[str, BlockFiles] = {}

    def read_into(self, location: str, block_hash: bytes, out: torch.Tensor) -> bool:
        files = self._files(location)
        return files is not None and files.read_into(block_hash, out)

    def _files(self, location: str) -> BlockFiles | None:
        files = self._folders.get(location)
        if files is None and Path(location).resolve().parent == self._root:
            files = open_block_files(location, self._config, self._block_shape, self._dtype)
            if files is not None:
                self._folders[location] = files
        return files
