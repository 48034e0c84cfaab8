"""`python -m loadtest overload`: the client's retry delay and the report's verdicts on made-up attempts."""

from __future__ import annotations

import random

import pytest

from loadtest.client import RequestRecord
from loadtest.overload import (
    CAPACITY,
    RECOVERY,
    SURGE,
    Attempt,
    OverloadConfig,
    OverloadResult,
    retry_delay,
    surge_classes,
)
from loadtest.overload_report import build_overload_report, overload_markdown
from loadtest.workload import BATCH, INTERACTIVE


def test_retry_after_is_honoured_and_jittered_never_below_the_backoff() -> None:
    rng = random.Random(0)

    assert 3.0 <= retry_delay("3", 0.5, rng) <= 4.5
    assert 8.0 <= retry_delay("1", 8.0, rng) <= 12.0
    assert 0.5 <= retry_delay(None, 0.5, rng) <= 0.75
    assert 2.0 <= retry_delay("Wed, 21 Oct 2026 07:28:00 GMT", 2.0, rng) <= 3.0


def served(phase: str, klass: str, at: float, tokens: int = 50) -> Attempt:
    return Attempt(phase, RequestRecord("alice", klass, at, "ok", 0.2, 2.0, [at + 2], completion_tokens=tokens))


def refused(phase: str, klass: str, at: float, status: str = "429", retry_after: str | None = "1", *,
            is_retry: bool = False) -> Attempt:
    return Attempt(phase, RequestRecord("alice", klass, at, status, e2e_s=0.01, retry_after=retry_after), is_retry)


def result(attempts: list[Attempt], recovery_s: float | None = 3.0) -> OverloadResult:
    spans = {CAPACITY: (0.0, 10.0), SURGE: (10.0, 20.0), RECOVERY: (20.0, 25.0)}
    return OverloadResult(OverloadConfig("http://127.0.0.1:1"), "m", attempts, spans, recovery_s)


def healthy_run() -> list[Attempt]:
    return ([served(CAPACITY, INTERACTIVE, t) for t in range(8)]
            + [served(SURGE, INTERACTIVE, 10 + t) for t in range(8)]
            + [refused(SURGE, BATCH, 10 + t) for t in range(6)] + [served(SURGE, BATCH, 12)]
            + [served(RECOVERY, INTERACTIVE, 21)])


def test_a_server_that_sheds_batch_and_keeps_interactive_goodput_holds() -> None:
    report = build_overload_report(result(healthy_run()))

    assert report["passed"], report["failures"]
    surge = report["phases"][SURGE]
    assert surge["by_class"][BATCH]["refused_share"] == pytest.approx(6 / 7)
    assert surge["refused"] == surge["by_class"][BATCH]["refused"] == 6
    assert surge["by_class"][INTERACTIVE]["refused"] == 0
    assert surge["by_class"][INTERACTIVE]["goodput_tokens_per_s"] == pytest.approx(40.0)
    assert report["surge_goodput_vs_capacity"] == pytest.approx(45 / 40)
    assert "held" in overload_markdown(report)


@pytest.mark.parametrize(("extra", "recovery_s", "failure"), [
    ([refused(SURGE, INTERACTIVE, 15, "500")], 3.0, "5xx"),
    ([refused(SURGE, BATCH, 15, "503", retry_after=None)], 3.0, "without Retry-After"),
    ([refused(SURGE, INTERACTIVE, 10 + t) for t in range(60)], 3.0, "refused more often"),
    ([], None, "did not recover"),
])
def test_each_way_of_failing_is_named(extra: list[Attempt], recovery_s: float | None, failure: str) -> None:
    report = build_overload_report(result(healthy_run() + extra, recovery_s))

    assert not report["passed"]
    assert any(failure in f for f in report["failures"]), report["failures"]


def test_collapsed_interactive_goodput_fails() -> None:
    attempts = [a for a in healthy_run() if not (a.phase == SURGE and a.record.klass == INTERACTIVE)]
    report = build_overload_report(result([*attempts, served(SURGE, INTERACTIVE, 11, tokens=10)]))

    assert any("collapsed" in f for f in report["failures"])


def test_refusals_are_counted_per_class_in_the_summary() -> None:
    attempts = [*healthy_run(), refused(SURGE, INTERACTIVE, 13, "503")]
    summary = overload_markdown(build_overload_report(result(attempts)))

    assert "| surge / batch | 7 | 1 | 6 | 85.7% |" in summary
    assert "| surge / interactive | 9 | 8 | 1 | 11.1% |" in summary
    assert "Nothing was refused" not in summary


def test_requests_that_failed_other_than_by_refusal_are_listed() -> None:
    cut = RequestRecord("alice", BATCH, 14.0, e2e_s=3.0, status=200, num_events=5, num_bytes=800)
    cut.fail("transport_error", "RemoteProtocolError", "peer closed connection")
    report = build_overload_report(result([*healthy_run(), Attempt(SURGE, cut)]))
    summary = overload_markdown(report)

    assert report["failed_requests"]["count"] == 1  # the surge's refusals are not listed
    listed = report["failed_requests"]["listed"][0]
    assert (listed["phase"], listed["class"], listed["reason"]) == (SURGE, BATCH, "RemoteProtocolError")
    assert "Requests that did not end ok, refusals (429, 503) aside: 1" in summary
    assert "| surge | batch | alice | 200 | transport_error | RemoteProtocolError | 5 / 800 |" in summary


def test_a_surge_without_refusals_says_the_shedding_was_not_tried() -> None:
    attempts = [a for a in healthy_run() if a.record.outcome == "ok"]
    report = build_overload_report(result(attempts))

    assert report["passed"], report["failures"]
    assert "Nothing was refused in the surge" in overload_markdown(report)


def test_a_surge_of_batch_users_only_is_judged_without_the_class_comparison() -> None:
    attempts = [a for a in healthy_run() if not (a.phase == SURGE and a.record.klass == INTERACTIVE)]
    report = build_overload_report(result(attempts))

    assert not any("refused more often" in f for f in report["failures"])


def test_batch_shed_first_is_judged_per_request_not_per_attempt() -> None:
    """Interactive requests mostly got in; one was tried 60 times while the admitted clients sat in
    their requests. Per attempt interactive looks refused more often than batch, per request it was not."""
    one_retried = [refused(SURGE, INTERACTIVE, 10 + t / 6, is_retry=t > 0) for t in range(60)]
    report = build_overload_report(result(healthy_run() + one_retried))
    by_class = report["phases"][SURGE]["by_class"]
    interactive, batch = by_class[INTERACTIVE], by_class[BATCH]

    assert interactive["refused_share"] > batch["refused_share"]  # 60 of 68 attempts, against 6 of 7
    assert (interactive["requests_refused"], interactive["requests"]) == (1, 9)
    assert interactive["requests_refused_share"] < batch["requests_refused_share"]
    assert report["passed"], report["failures"]


@pytest.mark.parametrize("batch_share", [0.0, 0.25, 0.5, 0.9])
def test_the_surge_starts_its_classes_interleaved(batch_share: float) -> None:
    """Users start in list order and the first take the empty queue's places: no class goes first."""
    classes = surge_classes(OverloadConfig("http://127.0.0.1:1", capacity_clients=8, factor=10,
                                           batch_share=batch_share))

    assert len(classes) == 80 and classes.count(BATCH) == round(80 * batch_share)
    assert all(abs(classes[:n].count(BATCH) - n * batch_share) <= 1 for n in range(1, 81))
