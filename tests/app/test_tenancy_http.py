"""Tenants over HTTP: API keys (401), class rights (403), quotas (429/400 with OpenAI's headers), and
prefix-cache isolation between tenants, on a real server with a tenants file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from benchmarks.fake_executors import instant_geometry
from config.settings import load_settings
from gpu.tokenizer import ByteTokenizer
from tests.app.conftest import (
    INSTANT_SETTINGS,
    ServerThread,
    SteppedExecutor,
    _context,
    fresh_db_path,
    instant_context,
)
from tests.tenants_files import tenants_toml

KEYS = {"alice": "fl-alice-key", "bob": "fl-bob-key", "carol": "fl-carol-key", "dave": "fl-dave-key",
        "erin": "fl-erin-key"}
REVOKED_KEY = "fl-alice-old-key"  # was alice's; its hash is no longer in the file

TENANTS_TOML = tenants_toml(KEYS, settings={
    "alice": {"weight": 2, "tokens_per_minute": 600, "max_prompt_tokens": 200},
    "bob": {"classes": ["interactive"], "max_concurrent": 1},
    "dave": {"cache_group": "team"},
    "erin": {"cache_group": "team"},
})


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS_TOML)
    return path


@pytest.fixture(scope="module")
def server(tenants_file: Path) -> Iterator[ServerThread]:
    started = ServerThread(instant_context(tenants_file=str(tenants_file))).start()
    yield started
    started.stop()


def post(server: ServerThread, key: str | None, **body: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    payload = {"model": server.model_name, "prompt": "hello", "max_tokens": 8, **body}
    return httpx.post(f"{server.base_url}/v1/completions", json=payload, headers=headers, timeout=30)


@pytest.mark.parametrize("key", [None, "fl-wrong", REVOKED_KEY])
def test_requests_without_a_valid_key_get_401(server: ServerThread, key: str | None) -> None:
    response = post(server, key)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    models = httpx.get(f"{server.base_url}/v1/models",
                       headers={"authorization": f"Bearer {key}"} if key else {}, timeout=10)
    assert models.status_code == 401


def test_a_valid_key_is_served_with_rate_limit_headers(server: ServerThread) -> None:
    response = post(server, KEYS["carol"])
    assert response.status_code == 200, response.text
    assert server.engine.submitted[-1].tenant_id == "carol"
    limited = post(server, KEYS["alice"], max_tokens=10)
    assert limited.status_code == 200
    assert limited.headers["x-ratelimit-limit-tokens"] == "600"
    assert int(limited.headers["x-ratelimit-remaining-tokens"]) <= 600 - 10


def test_the_official_client_authenticates_with_its_api_key(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS["carol"], max_retries=0)
    assert client.completions.create(model=server.model_name, prompt="hi", max_tokens=4).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="fl-wrong", max_retries=0).models.list()


def test_a_class_the_tenant_may_not_use_gets_403(server: ServerThread) -> None:
    response = post(server, KEYS["bob"], service_tier="flex")
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "class_not_allowed"
    assert post(server, KEYS["carol"], service_tier="flex").status_code == 200


def test_token_bucket_exhausted_gets_429_with_headers(tenants_file: Path) -> None:
    server = ServerThread(instant_context(tenants_file=str(tenants_file))).start()
    try:
        # The byte tokenizer: "hello" is 5 tokens; 5 + 295 = 300 of alice's 600 per minute, twice.
        assert post(server, KEYS["alice"], max_tokens=295, ignore_eos=True).status_code == 200
        assert post(server, KEYS["alice"], max_tokens=290, ignore_eos=True).status_code == 200
        refused = post(server, KEYS["alice"], max_tokens=100)
    finally:
        server.stop()
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    headers = refused.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-tokens"] == "600"
    assert int(headers["x-ratelimit-remaining-tokens"]) < 105
    assert headers["x-ratelimit-reset-tokens"].endswith("s")


def test_prompt_over_the_tenant_limit_gets_400(server: ServerThread) -> None:
    response = post(server, KEYS["alice"], prompt="x" * 201)
    assert response.status_code == 400
    assert "200" in response.json()["error"]["message"]


def test_requests_in_flight_over_the_limit_get_429(tenants_file: Path) -> None:
    settings = load_settings(environ={}, overrides={**INSTANT_SETTINGS, "tenants_file": str(tenants_file),
                                                    "batch_db_path": fresh_db_path()})
    executor = SteppedExecutor(instant_geometry(settings, max_model_len=1024))
    server = ServerThread(_context(settings, executor, ByteTokenizer())).start()
    headers = {"authorization": f"Bearer {KEYS['bob']}"}
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{server.base_url}/v1/chat/completions", json={**body, "stream": True},
                               headers=headers) as first:
                assert first.status_code == 200
                chunks = first.iter_bytes()
                next(chunks)  # the role chunk: admitted, and held in the engine
                refused = client.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers)
                executor.open()
                assert b"[DONE]" in b"".join(chunks)
            after = client.post(f"{server.base_url}/v1/chat/completions", json=body, headers=headers)
    finally:
        executor.open()
        server.stop()
    assert refused.status_code == 429
    assert refused.headers["x-ratelimit-limit-requests"] == "1"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert after.status_code == 200  # the first request's end gave its slot back


def cached_tokens(server: ServerThread, key: str, prompt: str, **body: Any) -> int:
    response = post(server, key, prompt=prompt, max_tokens=2, **body)
    assert response.status_code == 200, response.text
    details: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return details


def test_prefix_cache_is_isolated_between_tenants(start_tiny_server: Callable[..., ServerThread],
                                                 tenants_file: Path) -> None:
    server = start_tiny_server(tenants_file=str(tenants_file))
    shared = "The same long system prompt, repeated by everyone who calls this server. " * 2  # > 100 bytes
    assert cached_tokens(server, KEYS["carol"], shared + "one") == 0
    assert cached_tokens(server, KEYS["carol"], shared + "two") >= 128  # its own prefix: cached
    assert cached_tokens(server, KEYS["alice"], shared + "three") == 0  # another tenant: never shared
    assert cached_tokens(server, KEYS["dave"], shared + "four") == 0
    assert cached_tokens(server, KEYS["erin"], shared + "five") >= 128  # same cache group as dave
    assert cached_tokens(server, KEYS["erin"], shared + "six", cache_salt="private") == 0  # its own salt
