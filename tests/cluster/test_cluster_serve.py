"""`fairlane serve --replicas 2` end to end: the official openai client against two replicas of
builtin:tiny on a local Ray instance, all on loopback. One cluster serves the whole module (Ray and
two model loads take tens of seconds); the tests that kill a replica run last."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.app.conftest import wait_for
from tests.cluster.sockets import listening_sockets, off_loopback, raw_exchange
from tests.tenants_files import tenants_toml

FAIRLANE = Path(sys.executable).with_name("fairlane")
MODEL = "builtin:tiny"
ADMIN_KEY = "fl-admin-key"
KEYS = {"alice": "fl-alice-key", "capped": "fl-capped-key"}
MAX_CONCURRENT = 2
TENANTS_TOML = tenants_toml(KEYS, admin_key=ADMIN_KEY, settings={"capped": {"max_concurrent": MAX_CONCURRENT}})
START_TIMEOUT_S = 150
LONG = 1500  # max_tokens of a stream that the test ends long before it would end by itself
NUM_BATCH_ITEMS = 8
BATCH_ITEM_TOKENS = 300  # long enough that items are still running when their replica is killed
# 5 s, not 2: with the suite's other worker compiling on both cores, a poll's head once waited past 2 s in
# the proxy and came back a 408.
HEAD_TIMEOUT_S = 5.0
BODY_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 32  # the connection cap; the other tests hold far fewer at once
# Waits on /stats: each poll is a request through Serve's proxy and the ingress, so polls come at 5 Hz,
# not 100 (a poll every 10 ms kept both loops busy beside the streams they wait on). A closed stream ends
# through the proxy noticing its client gone, which a loaded machine has been seen to take over 20 s for.
STATS_POLL_S = 0.2
STATS_WAIT_S = 60.0


@dataclass(slots=True)
class Cluster:
    process: subprocess.Popen[bytes]
    base_url: str
    streaming: dict[str, openai.OpenAI] = field(default_factory=dict)  # per tenant, for long_stream; closed at the end
    keys: dict[str, str] = field(default_factory=lambda: KEYS)  # API keys by tenant

    def client(self, tenant: str = "alice") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.keys[tenant], max_retries=0, timeout=60)

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.base_url}/stats", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats

    def metrics(self) -> str:
        response = httpx.get(f"{self.base_url}/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"},
                             timeout=10)
        response.raise_for_status()
        return response.text

    def is_healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


# Serve's proxy binds its port seconds after the port is chosen. A port the kernel hands out for bind(0)
# can go to any process in that window (once the proxy then failed to bind, and a module's tests errored),
# so the port is drawn between Ray's worker ports (10002-19999) and the kernel's ephemeral range.
PROXY_PORTS = range(20000, 32768)


def loopback_port() -> int:
    """A free port for Serve's proxy, which binds it itself and cannot be handed a socket."""
    for port in random.sample(PROXY_PORTS, 64):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port among 64 drawn from {PROXY_PORTS}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("cluster")
    (folder / "tenants.toml").write_text(TENANTS_TOML)
    port = loopback_port()
    env = {**os.environ, "FAIRLANE_BATCH_DB_PATH": str(folder / "fairlane.db"), "FAIRLANE_MAX_NUM_SEQS": "8",
           "FAIRLANE_HTTP_HEADER_TIMEOUT_S": str(HEAD_TIMEOUT_S), "FAIRLANE_HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
           "FAIRLANE_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    log = (folder / "serve.log").open("wb")
    process = subprocess.Popen([str(FAIRLANE), "serve", "--replicas", "2", "--model", MODEL, "--port", str(port),
                                "--tenants", str(folder / "tenants.toml"), "--kv-cache-bytes", str(32 * 1024 * 1024)],
                               env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    served = Cluster(process, f"http://127.0.0.1:{port}")
    try:
        wait_for(lambda: served.is_healthy() or process.poll() is not None, timeout=START_TIMEOUT_S, interval=0.5,
                 what="the cluster to serve")
        assert process.poll() is None, (folder / "serve.log").read_text()[-4000:]
        wait_for(lambda: len(served.stats()["replicas"]) == 2, timeout=30, interval=0.2, what="both replicas")
        yield served
    finally:
        for client in served.streaming.values():
            client.close()
        stop(process)
        log.close()


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the cluster drains and stops), then SIGKILL to its whole session if it is still up."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def long_stream(cluster: Cluster, tenant: str = "alice", prompt: str = "Once upon a time") -> Any:
    client = cluster.streaming.setdefault(tenant, cluster.client(tenant))
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=LONG, stream=True,
                                                     extra_body={"ignore_eos": True})


def wait_for_stats(cluster: Cluster, predicate: Callable[[dict[str, Any]], bool], what: str) -> None:
    wait_for(lambda: predicate(cluster.stats()), timeout=STATS_WAIT_S, interval=STATS_POLL_S, what=what)


def total(stats: dict[str, Any], key: str) -> int:
    return sum(int(replica[key]) for replica in stats["replicas"].values())


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def has_two_live_replicas(cluster: Cluster) -> bool:
    """Both replicas report, healthy, and neither is one killed earlier (its last report ages out)."""
    replicas = cluster.stats()["replicas"].values()
    return len(replicas) == 2 and all(r["healthy"] and is_alive(r["pid"]) for r in replicas)


def replica_series(exposition: str) -> dict[str, set[str]]:
    """Per sample name, the replica label values of its series."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if "replica" in sample.labels:
                assert sample.labels["model_name"] == MODEL
                found.setdefault(sample.name, set()).add(sample.labels["replica"])
    return found


def test_chat_streams_through_the_official_client(cluster: Cluster) -> None:
    with cluster.client() as client:
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=12, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage

    assert finishes == ["length"]
    assert usage is not None and usage.completion_tokens == 12


def test_requests_are_served_by_both_replicas(cluster: Cluster) -> None:
    before = {rid: r["requests_finished"] for rid, r in cluster.stats()["replicas"].items()}
    streams = [long_stream(cluster, prompt=f"prompt number {i} " * 3) for i in range(6)]
    for stream in streams:
        next(iter(stream))  # every request is running before any ends
    for stream in streams:
        stream.close()
    wait_for_stats(cluster, lambda stats: stats["in_flight"] == 0, what="the streams to end")
    wait_for_stats(cluster, lambda stats: stats["running"] == 0, what="the replicas to report them ended")
    after = cluster.stats()["replicas"]

    assert all(after[rid]["requests_finished"] + after[rid]["requests_aborted"] > before[rid] for rid in before)


def test_a_client_that_disconnects_aborts_its_request_on_the_replica(cluster: Cluster) -> None:
    aborted = total(cluster.stats(), "requests_aborted")
    stream = long_stream(cluster)
    next(iter(stream))
    wait_for_stats(cluster, lambda stats: stats["running"] == 1, what="the replica to run the request")
    stream.close()

    wait_for_stats(cluster, lambda stats: total(stats, "requests_aborted") == aborted + 1,
                   what="the replica to abort the request")
    assert cluster.stats()["running"] == 0


def test_max_concurrent_is_counted_across_replicas(cluster: Cluster) -> None:
    streams = [long_stream(cluster, "capped", prompt=f"capped {i} " * 4) for i in range(MAX_CONCURRENT)]
    for stream in streams:
        next(iter(stream))
    try:
        with pytest.raises(openai.RateLimitError), cluster.client("capped") as client:
            client.completions.create(model=MODEL, prompt="one more", max_tokens=2)
    finally:
        for stream in streams:
            stream.close()
    with cluster.client("capped") as client:
        wait_for_stats(cluster, lambda stats: stats["in_flight"] == 0, what="the capped streams to end")
        assert client.completions.create(model=MODEL, prompt="now there is room", max_tokens=2).choices


def test_metrics_cover_every_replica_labelled_by_replica(cluster: Cluster) -> None:
    replica_ids = set(cluster.stats()["replicas"])
    series = replica_series(cluster.metrics())

    for name in ("fairlane:num_requests_running", "fairlane:num_requests_waiting", "fairlane:num_requests_swapped",
                 "fairlane:kv_cache_usage_perc", "fairlane:cpu_swap_usage_perc", "fairlane:num_preemptions_total",
                 "fairlane:prefix_cache_queries_total", "fairlane:prefix_cache_hits_total",
                 "fairlane:step_time_measured_seconds", "fairlane:tenant_vtc_counter"):
        assert series.get(name) == replica_ids, name
    assert "fairlane:request_success_total" not in series  # the ingress's own counters, once


def test_every_process_of_the_cluster_listens_on_loopback_only(cluster: Cluster) -> None:
    found = listening_sockets(cluster.process.pid)

    assert len(found) >= 5  # Ray's GCS and raylet, its workers, Serve's proxy and the replicas all listen
    assert any(port == int(cluster.base_url.rsplit(":", 1)[1]) for _, _, port in found)
    assert off_loopback(found) == []


def test_a_request_head_that_never_completes_is_cut_off_at_the_proxy(cluster: Cluster) -> None:
    host, port = cluster.base_url.removeprefix("http://").split(":")
    answer, waited_s = raw_exchange(host, int(port), b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n",
                                    wait_s=HEAD_TIMEOUT_S * 5)

    assert answer.startswith(b"HTTP/1.1 408")
    assert HEAD_TIMEOUT_S * 0.9 <= waited_s < HEAD_TIMEOUT_S * 5


def test_a_body_that_stops_arriving_gets_408_from_the_ingress(cluster: Cluster) -> None:
    host, port = cluster.base_url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEYS['alice']}\r\n"
            "content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\": ").encode()
    answer, waited_s = raw_exchange(host, int(port), head, wait_s=BODY_TIMEOUT_S * 10)

    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer
    assert waited_s >= BODY_TIMEOUT_S * 0.9


def test_connections_past_the_cap_get_503(cluster: Cluster) -> None:
    host, port = cluster.base_url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        refused = httpx.get(f"{cluster.base_url}/health", timeout=5)
    finally:
        for connection in held:
            connection.close()

    assert refused.status_code == 503
    wait_for(cluster.is_healthy, timeout=HEAD_TIMEOUT_S * 5, what="the held connections to be let go")


def test_a_killed_replica_fails_its_streams_and_the_other_serves_on(cluster: Cluster) -> None:
    stream = long_stream(cluster)
    next(iter(stream))
    wait_for_stats(cluster, lambda stats: stats["running"] == 1, what="a replica to run the stream")
    victim = next(r for r in cluster.stats()["replicas"].values() if r["running"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)

    with pytest.raises(openai.APIError, match="replica"):
        for _ in stream:
            pass
    with cluster.client() as client:
        answer = client.completions.create(model=MODEL, prompt="still there?", max_tokens=4)
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert cluster.is_healthy()


def batch_line(number: int) -> str:
    body = {"model": MODEL, "prompt": f"batch item {number}", "max_tokens": BATCH_ITEM_TOKENS, "ignore_eos": True}
    return json.dumps({"custom_id": f"item-{number}", "method": "POST", "url": "/v1/completions", "body": body})


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.split("\n") if line]


def test_a_batch_ends_each_item_exactly_once_across_a_replica_restart(cluster: Cluster) -> None:
    """Items running on the killed replica end with an error line that says so, the others with their
    result: no item is lost or written twice."""
    wait_for(lambda: has_two_live_replicas(cluster), timeout=START_TIMEOUT_S, interval=0.5,
             what="Ray Serve to restart the replica killed before")
    content = "\n".join(batch_line(i) for i in range(NUM_BATCH_ITEMS)).encode()
    with cluster.client() as client:
        file_id = client.files.create(file=("items.jsonl", io.BytesIO(content)), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
        # The victim is a replica seen running items, in the same report: read from a second one, it could be
        # one whose items had just ended, and the kill then hit nothing.
        running: list[dict[str, Any]] = []

        def a_replica_runs_items() -> bool:
            running[:] = [r for r in cluster.stats()["replicas"].values() if int(r["running"]) > 0]
            return bool(running)

        wait_for(a_replica_runs_items, timeout=30, interval=0.1, what="a replica to run batch items")
        os.kill(running[0]["pid"], signal.SIGKILL)
        wait_for(lambda: client.batches.retrieve(batch.id).status not in ("validating", "in_progress", "finalizing"),
                 timeout=180, interval=0.5, what="the batch to end")
        done = client.batches.retrieve(batch.id)
        results, errors = file_lines(client, done.output_file_id), file_lines(client, done.error_file_id)

    ended = Counter(line["custom_id"] for line in results + errors)
    assert done.status == "completed"
    assert ended == Counter(f"item-{i}" for i in range(NUM_BATCH_ITEMS))  # each exactly once
    assert all(line["response"]["status_code"] == 200 for line in results)
    assert errors  # the kill hit running items
    for line in errors:
        assert line["response"]["status_code"] == 500
        assert "replica serving this request failed" in line["response"]["body"]["error"]["message"]
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (len(results), len(errors))


def test_sigterm_drains_with_503_and_retry_after_for_new_requests(cluster: Cluster) -> None:
    """Last: it stops the cluster. New requests get the single server's 503 while running ones finish."""
    wait_for(lambda: has_two_live_replicas(cluster), timeout=START_TIMEOUT_S, interval=0.5,
             what="Ray Serve to restart the replica killed before")
    stream = long_stream(cluster)
    next(iter(stream))
    cluster.process.send_signal(signal.SIGTERM)

    def refused() -> httpx.Response | None:
        response = httpx.post(f"{cluster.base_url}/v1/completions", json={"model": MODEL, "prompt": "late"},
                              headers={"authorization": f"Bearer {KEYS['alice']}"}, timeout=10)
        return response if response.status_code == 503 else None

    wait_for(lambda: refused() is not None, timeout=20, interval=0.2, what="new requests to be refused")
    response = refused()
    stream.close()

    assert response is not None and response.headers["retry-after"]
    assert response.json()["error"]["code"] == "server_shutting_down"
