"""`fairlane serve --prefill-replicas 1 --decode-replicas 1` end to end on builtin:tiny (eager float32),
beside a colocated single server: the official openai client gets the same greedy text from both; the
decode replica receives the prompt's full blocks as prefix-cache hits; tenants' salts hold across the
hand-off; both roles show in /metrics; every block comes back; a replica lost at either side still
ends each request once, with its whole output. One cluster serves the module; the kills come last."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.app.conftest import wait_for
from tests.cluster.test_cluster_serve import (
    ADMIN_KEY,
    FAIRLANE,
    START_TIMEOUT_S,
    Cluster,
    is_alive,
    loopback_port,
    replica_series,
    stop,
)
from tests.tenants_files import tenants_toml

pytestmark = pytest.mark.slow

MODEL = "builtin:tiny"
KEYS = {"alice": "fl-alice-key", "bob": "fl-bob-key"}
BLOCK = 16
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 5, "Once upon a time, in a land far away, " * 4,
           "Fair queues share the device by weight; " * 6]
LONG = 1200  # max_tokens of a stream still decoding when its decode replica is killed


def start_server(folder: Path, args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Cluster]:
    port = loopback_port()
    log = (folder / "serve.log").open("wb")
    process = subprocess.Popen([str(FAIRLANE), "serve", "--model", MODEL, "--port", str(port),
                                "--tenants", str(folder.parent / "tenants.toml"), *args],
                               env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    log.close()  # the child has its own descriptor
    return process, Cluster(process, f"http://127.0.0.1:{port}", keys=KEYS)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Cluster]]:
    """(the disaggregated cluster, a colocated single server), both eager so their arithmetic is alike."""
    folder = tmp_path_factory.mktemp("disaggregated")
    (folder / "tenants.toml").write_text(tenants_toml(KEYS, admin_key=ADMIN_KEY))
    (folder / "cluster").mkdir()
    (folder / "single").mkdir()
    env = {"FAIRLANE_COMPILE_MODE": "eager", "FAIRLANE_MAX_NUM_SEQS": "8", "FAIRLANE_SPECULATIVE_CONFIG": "none",
           "FAIRLANE_DISAGGREGATION_MIN_PROMPT_TOKENS": "0"}
    started: list[subprocess.Popen[bytes]] = []
    try:
        cluster_process, cluster = start_server(folder / "cluster", [
            "--prefill-replicas", "1", "--decode-replicas", "1", "--kv-cache-bytes", str(32 * 1024 * 1024)], {
            **env, "FAIRLANE_BATCH_DB_PATH": str(folder / "cluster" / "f.db"),
            "FAIRLANE_KV_HANDOFF_PATH": str(folder / "cluster" / "handoff")})
        started.append(cluster_process)
        single_process, single = start_server(folder / "single", ["--kv-cache-bytes", str(32 * 1024 * 1024)], {
            **env, "FAIRLANE_BATCH_DB_PATH": str(folder / "single" / "f.db")})
        started.append(single_process)
        for name, process, served in (("cluster", cluster_process, cluster), ("single", single_process, single)):
            wait_for(lambda: served.is_healthy() or process.poll() is not None,  # noqa: B023
                     timeout=START_TIMEOUT_S, interval=0.5, what=f"the {name} server to serve")
            assert process.poll() is None, (folder / name / "serve.log").read_text()[-4000:]
        wait_for(lambda: len(cluster.stats()["replicas"]) == 2, timeout=30, interval=0.2, what="both replicas")
        yield cluster, single
    finally:
        for process in started:
            stop(process)


def replica(cluster: Cluster, role: str) -> dict[str, Any]:
    found: dict[str, Any] = next(r for r in cluster.stats()["replicas"].values() if r["role"] == role)
    return found


def settled(cluster: Cluster, role: str) -> dict[str, Any]:
    """The replica's stats once they stand still: nothing running, and its hand-off counters unchanged over
    a second, so an earlier test's hand-off is counted before a test takes its baseline."""
    seen: list[dict[str, Any]] = []

    def still() -> bool:
        seen.append(replica(cluster, role))
        return len(seen) > 1 and seen[-1]["handoff"] == seen[-2]["handoff"] and seen[-1]["running"] == 0

    wait_for(still, timeout=30, interval=1.0, what=f"the {role} replica's stats to settle")
    return seen[-1]


def handoffs_after(cluster: Cluster, role: str, key: str, count: int) -> dict[str, Any]:
    """The replica's stats once its `handoff[key]` passed count: /stats shows the replicas' latest
    reports to the board, a fraction of a second behind."""
    wait_for(lambda: replica(cluster, role)["handoff"][key] >= count, timeout=10, interval=0.1,
             what=f"the {role} replica's {key} to reach {count}")
    return replica(cluster, role)


def stream_text(served: Cluster, prompt: str, tenant: str = "alice", max_tokens: int = 24) -> tuple[str, Any]:
    with served.client(tenant) as client:
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        text, usage = "", None
        for chunk in stream:
            text += "".join(choice.text for choice in chunk.choices)
            usage = chunk.usage or usage
    return text, usage


def test_greedy_output_is_the_colocated_servers(servers: tuple[Cluster, Cluster]) -> None:
    cluster, single = servers
    for prompt in PROMPTS:
        assert stream_text(cluster, prompt)[0] == stream_text(single, prompt)[0]
    with cluster.client() as client, single.client() as alone:
        messages = [{"role": "user", "content": PROMPTS[0]}]
        answers = [c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)  # type: ignore[arg-type]
                   for c in (client, alone)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    handoffs_after(cluster, "prefill", "published", len(PROMPTS) + 1)


def test_the_decode_replica_receives_the_prompts_full_blocks(servers: tuple[Cluster, Cluster]) -> None:
    cluster, _ = servers
    prompt = "A prompt of its own, never sent before this test. " * 5
    before = settled(cluster, "decode")
    _, usage = stream_text(cluster, prompt)
    handoffs_after(cluster, "decode", "received", before["handoff"]["received"] + 1)
    full_blocks = usage.prompt_tokens // BLOCK
    # A report can count the handoff and not yet the admission that hit its blocks: wait for both.
    hits_before = before["prefix_cache"]["hit_tokens"]
    wait_for(lambda: replica(cluster, "decode")["prefix_cache"]["hit_tokens"] > hits_before, timeout=10,
             interval=0.1, what="the decode replica's report of the prefix hit")
    after = replica(cluster, "decode")
    assert after["handoff"]["blocks_received"] - before["handoff"]["blocks_received"] == full_blocks
    assert after["prefix_cache"]["hit_tokens"] - hits_before == full_blocks * BLOCK
    assert usage.prompt_tokens_details.cached_tokens == 0  # the tenant's usage counts the prefill side's cache
    _, again = stream_text(cluster, prompt)
    assert again.prompt_tokens_details.cached_tokens == full_blocks * BLOCK


def test_a_tenants_salt_holds_across_the_handoff(servers: tuple[Cluster, Cluster]) -> None:
    cluster, _ = servers
    prompt = "Alice wrote this prompt first; Bob sends the same words. " * 4
    before = settled(cluster, "decode")["handoff"]
    stream_text(cluster, prompt, tenant="alice")
    _, usage = stream_text(cluster, prompt, tenant="bob")
    assert usage.prompt_tokens_details.cached_tokens == 0
    # Bob's own blocks were published and received: Alice's, on both replicas, were no hit for him.
    after = handoffs_after(cluster, "decode", "received", before["received"] + 2)["handoff"]
    assert after["blocks_received"] - before["blocks_received"] == 2 * (usage.prompt_tokens // BLOCK)


def test_metrics_show_each_role_and_the_handoff(servers: tuple[Cluster, Cluster]) -> None:
    cluster, _ = servers
    series = replica_series(cluster.metrics())
    assert len(series["fairlane:num_requests_running"]) == 2
    text = cluster.metrics()
    assert 'fairlane:kv_handoff_prompts_published_total{model_name="builtin:tiny",replica=' in text
    assert 'role="prefill"' in text and 'role="decode"' in text
    assert "fairlane:kv_handoff_fetch_seconds_total" in text


def test_every_block_comes_back_on_both_sides(servers: tuple[Cluster, Cluster]) -> None:
    cluster, _ = servers
    for prompt in PROMPTS:
        stream_text(cluster, prompt, max_tokens=40)
    wait_for(lambda: all(r["kv_blocks_in_use"] == 0 and r["running"] == 0
                         for r in cluster.stats()["replicas"].values()),
             timeout=30, interval=0.2, what="every replica to hold no block")


def test_a_decode_replica_lost_mid_decode_hands_the_request_on_whole(servers: tuple[Cluster, Cluster]) -> None:
    cluster, _ = servers
    with cluster.client() as client:
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=LONG, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        wait_for(lambda: replica(cluster, "decode")["running"] == 1, timeout=30, interval=0.05,
                 what="the decode replica to run the stream")
        victim = replica(cluster, "decode")["pid"]
        os.kill(victim, signal.SIGKILL)
        usage, finish = None, None
        for chunk in chunks:
            usage = chunk.usage or usage
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
    assert not is_alive(victim)
    assert finish == "length" and usage is not None and usage.completion_tokens == LONG


def test_a_request_sent_as_its_prefill_replica_dies_still_ends_whole(servers: tuple[Cluster, Cluster]) -> None:
    cluster, _ = servers
    wait_for(lambda: {r["role"] for r in cluster.stats()["replicas"].values() if is_alive(r["pid"])}
             == {"prefill", "decode"}, timeout=START_TIMEOUT_S, interval=0.5, what="both roles to be live")
    os.kill(replica(cluster, "prefill")["pid"], signal.SIGKILL)
    text, usage = stream_text(cluster, PROMPTS[2], max_tokens=32)
    assert usage.completion_tokens == 32 and text
