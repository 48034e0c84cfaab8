"""How the launcher asks Ray for the replicas' resources."""

from __future__ import annotations

import pytest

from cluster.placement import gpu_share


@pytest.mark.parametrize(("gpus", "replicas", "device", "share"), [
    (0, 2, "auto", 0.0), (4, 2, "cpu", 0.0),  # nothing to share, or asked not to
    (1, 1, "auto", 1.0), (4, 2, "cuda", 1.0),  # one each while there are enough
    (1, 2, "auto", 0.5), (1, 3, "cuda", 0.3333), (2, 3, "auto", 0.6666),  # else an equal share
])
def test_each_replica_asks_its_share_of_the_gpus_ray_sees(gpus: float, replicas: int, device: str,
                                                          share: float) -> None:
    assert gpu_share(gpus, replicas, device) == share
    assert gpu_share(gpus, replicas, device) * replicas <= max(gpus, 0)
