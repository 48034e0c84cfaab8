"""`fairlane bench queue-order`: the order inside a tenant's line moves first tokens, not the tenants' shares."""

from __future__ import annotations

from benchmarks.bench_queue_order import make_trace, run_order


def test_shortest_work_first_cuts_the_mean_first_token_and_leaves_the_shares_as_vtc_keeps_them() -> None:
    trace = make_trace(duration_s=120.0, seed=0, load=1.3)

    fcfs = run_order("fcfs", trace, seed=0, aging_s=300.0, fcfs_stretch=1.3)
    srpt = run_order("srpt", trace, seed=0, aging_s=300.0, fcfs_stretch=1.3)

    assert srpt["ttft_mean_s"] < 0.9 * fcfs["ttft_mean_s"]
    # Service in VTC's units while both tenants have unfinished requests: what the counters level.
    assert fcfs["jain"] > 0.95
    assert abs(srpt["jain"] - fcfs["jain"]) <= 0.01
