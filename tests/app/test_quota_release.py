"""Whatever fails between the tenant's gate and the engine, no quota stays taken: each point of a
request's start is made to raise in turn, and after each the gate holds nothing and the tenant's one
slot admits the next request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.serving import submission
from app.serving.generation import TextGeneration
from tests.app.conftest import ServerThread, instant_context, wait_for
from tests.tenants_files import tenants_toml

KEY = "fl-solo-key"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path = tmp_path_factory.mktemp("quota") / "tenants.toml"
    path.write_text(tenants_toml({"solo": KEY}, settings={"solo": {"max_concurrent": 1, "max_queued": 1}}))
    started = ServerThread(instant_context(tenants_file=str(path))).start()
    yield started
    started.stop()


class Injected(Exception):
    pass


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise Injected("a failure between the gate and the engine")


def chat(server: ServerThread, **extra: Any) -> httpx.Response:
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {KEY}"})


@pytest.mark.parametrize(("target", "extra"), [
    ("engine submit", {}),
    ("the second choice's generation", {"n": 2}),
    ("the tool streams", {"tools": TOOLS}),
    ("the generations object", {}),
])
def test_a_failure_at_any_point_after_the_gate_gives_the_quota_back(server: ServerThread,
                                                                    monkeypatch: pytest.MonkeyPatch, target: str,
                                                                    extra: dict[str, Any]) -> None:
    if target == "engine submit":
        monkeypatch.setattr(server.context.engine, "submit", _raise)
    elif target == "the second choice's generation":
        made: list[object] = []
        real = TextGeneration

        def second_fails(*args: Any, **kwargs: Any) -> Any:
            if made:
                raise Injected("the second choice")
            made.append(real(*args, **kwargs))
            return made[-1]

        monkeypatch.setattr(submission, "TextGeneration", second_fails)
    elif target == "the tool streams":
        monkeypatch.setattr(submission, "ToolStream", _raise)
    else:
        monkeypatch.setattr(submission, "Generations", _raise)

    assert chat(server, **extra).status_code == 500
    monkeypatch.undo()
    wait_for(lambda: server.context.gate.num_held == 0, what="every admission to be released")
    assert chat(server).status_code == 200  # the tenant's one slot is free again
    assert server.context.gate.num_held == 0
