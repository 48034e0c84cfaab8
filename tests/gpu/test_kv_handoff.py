"""The folder transport of the KV hand-off: what one publisher writes, a receiver under the same root
reads back bit for bit; it reads nothing from outside that root, nothing of another configuration, and
nothing a publisher dropped past its capacity."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from gpu.kv_disk import DiskBlockStore
from gpu.kv_handoff import FolderPublisher, FolderReceiver

SHAPE = (2, 2, 1, 4, 8)  # layers, K/V, kv heads, block size, head dim
CONFIG: dict[str, str | int] = {"model": "test", "block_size": 4}


def block_hash(index: int) -> bytes:
    return hashlib.blake2b(str(index).encode(), digest_size=16).digest()


def block(index: int) -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE) + 1000 * index


def publisher(root: Path, name: str = "prefill-a", capacity_blocks: int = 8) -> FolderPublisher:
    file_bytes = 64 + block(0).numel() * 4
    return FolderPublisher(DiskBlockStore(root / name, CONFIG, SHAPE, torch.float32, capacity_blocks * file_bytes))


def receive(receiver: FolderReceiver, location: str, index: int) -> torch.Tensor | None:
    out = torch.zeros(SHAPE)
    return out if receiver.read_into(location, block_hash(index), out) else None


def test_published_blocks_are_received_bit_for_bit(tmp_path: Path) -> None:
    sender = publisher(tmp_path)
    sender.publish([(block_hash(i), block(i)) for i in range(3)])
    assert sender.wait_published([block_hash(i) for i in range(3)], timeout_s=10)
    receiver = FolderReceiver(tmp_path, CONFIG, SHAPE, torch.float32)
    for i in range(3):
        received = receive(receiver, sender.location, i)
        assert received is not None and torch.equal(received, block(i))
    assert receive(receiver, sender.location, 99) is None  # never published
    assert not sender.wait_published([block_hash(99)], timeout_s=1)
    sender.close()


def test_a_location_outside_the_root_or_of_another_configuration_gives_nothing(tmp_path: Path) -> None:
    sender = publisher(tmp_path / "elsewhere")
    sender.publish([(block_hash(0), block(0))])
    assert sender.wait_published([block_hash(0)], timeout_s=10)
    assert receive(FolderReceiver(tmp_path / "root", CONFIG, SHAPE, torch.float32), sender.location, 0) is None
    other_model = FolderReceiver(tmp_path / "elsewhere", {**CONFIG, "model": "other"}, SHAPE, torch.float32)
    assert receive(other_model, sender.location, 0) is None
    sender.close()


def test_a_receiver_finds_a_publisher_that_starts_after_it(tmp_path: Path) -> None:
    receiver = FolderReceiver(tmp_path, CONFIG, SHAPE, torch.float32)
    location = str(tmp_path / "prefill-late")
    assert receive(receiver, location, 0) is None
    sender = publisher(tmp_path, "prefill-late")
    sender.publish([(block_hash(0), block(0))])
    assert sender.wait_published([block_hash(0)], timeout_s=10)
    assert receive(receiver, location, 0) is not None
    sender.close()


def test_past_its_capacity_a_publisher_drops_its_oldest_blocks_and_keeps_republished_ones(tmp_path: Path) -> None:
    sender = publisher(tmp_path, capacity_blocks=4)
    sender.publish([(block_hash(i), block(i)) for i in range(4)])
    sender.publish([(block_hash(0), block(0))])  # published again: the newest now
    sender.publish([(block_hash(i), block(i)) for i in (4, 5)])
    assert sender.wait_published([block_hash(i) for i in (0, 3, 4, 5)], timeout_s=10)
    sender.close()  # finishes the queued deletes too: they come after the writes waited for
    receiver = FolderReceiver(tmp_path, CONFIG, SHAPE, torch.float32)
    kept = [i for i in range(6) if receive(receiver, sender.location, i) is not None]
    assert kept == [0, 3, 4, 5]


def test_a_corrupt_file_is_refused(tmp_path: Path) -> None:
    sender = publisher(tmp_path)
    sender.publish([(block_hash(0), block(0))])
    assert sender.wait_published([block_hash(0)], timeout_s=10)
    files = [p for p in (tmp_path / "prefill-a").rglob("*") if p.is_file() and p.name != "key"]
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))
    assert receive(FolderReceiver(tmp_path, CONFIG, SHAPE, torch.float32), sender.location, 0) is None
    sender.close()
