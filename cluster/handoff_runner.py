"""The runner's side of the KV hand-off on a replica (gpu/kv_handoff.py through a folder): a prefill
replica's publisher and a decode replica's reads into host blocks. Imports torch: replicas only."""

from __future__ import annotations

import re
from pathlib import Path

from cluster.handoff import ReadBlocks
from gpu.kv_disk import DiskBlockStore
from gpu.kv_handoff import FolderPublisher, FolderReceiver
from gpu.runner import ModelRunner

MAX_PENDING_BYTES = 512 << 20  # a prefill replica's block copies queued for the writer, at most


def open_publisher(runner: ModelRunner, root: str | Path, replica_id: str, capacity_bytes: int) -> FolderPublisher:
    """A folder of this replica's own under the hand-off root, which the runner publishes prompts into."""
    folder = Path(root) / re.sub(r"[^A-Za-z0-9_-]", "_", replica_id)
    # Copies waiting for the writer are bounded apart from the folder: past that, a block is not published
    # (the decode replica computes it), and a burst of long prompts cannot take the replica's memory.
    store = DiskBlockStore(folder, runner.block_file_config(), runner.block_file_shape(), runner.cache.shape.dtype,
                           capacity_bytes, max_pending_bytes=min(capacity_bytes, MAX_PENDING_BYTES))
    publisher = FolderPublisher(store)
    runner.publish_to(publisher)
    return publisher


def block_reader(runner: ModelRunner, root: str | Path) -> ReadBlocks:
    """Reads published blocks (of publishers under root) into the host blocks a decode replica's engine
    held for them."""
    receiver = FolderReceiver(root, runner.block_file_config(), runner.block_file_shape(), runner.cache.shape.dtype)

    def read(location: str, held: list[tuple[bytes, int]]) -> tuple[list[bytes], list[bytes]]:
        if runner.disk is not None:  # a held block's memory may still be lent to a queued disk-tier write
            runner.disk.reclaim([slot for _, slot in held])
        filled: list[bytes] = []
        for block_hash, slot in held:
            if not receiver.read_into(location, block_hash, runner.cache.host_block(slot)):
                break  # the chain stops here: the rest would never be a hit
            filled.append(block_hash)
        return filled, [block_hash for block_hash, _ in held[len(filled):]]

    return read
