"""The pure parts of `fairlane bench cluster`'s fairness measurement: service counted inside the
window, and the backlog read from /metrics. (The bench itself starts Ray clusters: it is not run here;
tests/cluster runs the cluster end to end.)"""

from __future__ import annotations

import pytest

from benchmarks.bench_cluster import Answer, Window, service_in_window, vtc_service, waiting_by_tenant

WINDOW = Window(start=10.0, end=20.0)


def answer(first_token_at: float, ended_at: float, prompt: int = 100, cached: int = 0, output: int = 10) -> Answer:
    return Answer("t", first_token_at - 1.0, prompt, cached, output, first_token_at, ended_at)


def test_an_answer_inside_the_window_counts_whole() -> None:
    inside = answer(12.0, 15.0, prompt=100, cached=50, output=10)
    assert service_in_window(inside, WINDOW, 2.0, 1.0) == vtc_service(inside, 2.0, 1.0) == pytest.approx(
        50 + 0.1 * 50 + 2.0 * 10)


def test_output_is_spread_over_the_answer_and_the_prompt_counts_at_its_first_token() -> None:
    straddling_end = answer(18.0, 22.0, prompt=100, output=10)  # half of its decoding inside
    assert service_in_window(straddling_end, WINDOW, 2.0, 1.0) == pytest.approx(100 + 2.0 * 10 / 2)
    straddling_start = answer(8.0, 12.0, prompt=100, output=10)  # prompt before the window
    assert service_in_window(straddling_start, WINDOW, 2.0, 1.0) == pytest.approx(2.0 * 10 / 2)
    outside = answer(21.0, 25.0)
    assert service_in_window(outside, WINDOW, 2.0, 1.0) == 0


def test_waiting_requests_are_added_up_per_tenant_over_replicas_and_classes() -> None:
    metrics = "\n".join([
        "# TYPE fairlane:tenant_requests_waiting gauge",
        'fairlane:tenant_requests_waiting{model_name="m",replica="r1",tenant="b",class="interactive"} 2.0',
        'fairlane:tenant_requests_waiting{model_name="m",replica="r2",tenant="b",class="interactive"} 1.0',
        'fairlane:tenant_requests_waiting{model_name="m",replica="r2",tenant="c",class="batch"} 3.0',
        'fairlane:num_requests_waiting{model_name="m",class="batch"} 9.0',
    ])
    assert waiting_by_tenant(metrics) == {"b": 3.0, "c": 3.0}
