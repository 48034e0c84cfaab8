"""Stored responses belong to their tenant: another tenant's id is 404 (never 403) for every way of
reaching it, and nothing it tries changes the owner's response."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from tests.app.conftest import ServerThread, instant_context, stepped_server, wait_for
from tests.tenants_files import tenants_toml

KEYS = {"alice": "fl-alice-key", "bob": "fl-bob-key"}


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(tenants_toml(KEYS, settings={"bob": {"classes": ["interactive"]}}))
    return path


@pytest.fixture(scope="module")
def server(tenants_file: Path) -> Iterator[ServerThread]:
    started = ServerThread(instant_context(tenants_file=str(tenants_file))).start()
    yield started
    started.stop()


def client_of(server: ServerThread, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[tenant], max_retries=0)


def attempts(bob: openai.OpenAI, model: str, response_id: str) -> dict[str, Callable[[], object]]:
    """Every way another tenant could reach a response by its id."""
    return {
        "retrieve": lambda: bob.responses.retrieve(response_id),
        "input_items": lambda: bob.responses.input_items.list(response_id),
        "continue": lambda: bob.responses.create(model=model, input="Go on.", previous_response_id=response_id),
        "cancel": lambda: bob.responses.cancel(response_id),
        "delete": lambda: bob.responses.delete(response_id),
    }


def test_another_tenants_response_is_404_every_way(server: ServerThread) -> None:
    with client_of(server, "alice") as alice, client_of(server, "bob") as bob:
        owned = alice.responses.create(model=server.model_name, input="Alice's secret.", max_output_tokens=4)
        for name, attempt in attempts(bob, server.model_name, owned.id).items():
            with pytest.raises(openai.NotFoundError):
                attempt()
            assert alice.responses.retrieve(owned.id).status == "incomplete", name

        assert [item.type for item in alice.responses.input_items.list(owned.id).data] == ["message"]
        continued = alice.responses.create(model=server.model_name, input="Go on.", previous_response_id=owned.id)
        assert continued.previous_response_id == owned.id


def test_another_tenants_background_response_cannot_be_cancelled(tenants_file: Path) -> None:
    server, executor = stepped_server(tenants_file)
    try:
        with client_of(server, "alice") as alice, client_of(server, "bob") as bob:
            running = alice.responses.create(model=server.model_name, input="Hi", background=True,
                                             max_output_tokens=6)
            for attempt in (lambda: bob.responses.cancel(running.id), lambda: bob.responses.delete(running.id)):
                with pytest.raises(openai.NotFoundError):
                    attempt()
            executor.open()
            wait_for(lambda: alice.responses.retrieve(running.id).status == "incomplete",
                     what="alice's response to end as it would have")
    finally:
        executor.open()
        server.stop()


def test_background_needs_the_batch_class(server: ServerThread) -> None:
    with client_of(server, "bob") as bob, pytest.raises(openai.PermissionDeniedError) as refused:
        bob.responses.create(model=server.model_name, input="Hi", background=True)
    assert refused.value.code == "class_not_allowed"
    assert refused.value.body is not None and "'background'" in str(refused.value.body)
