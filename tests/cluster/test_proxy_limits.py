"""The proxy's limits without Ray: once installed, a uvicorn left at its "auto" protocol (as Serve's
proxy is) loads fairlane's protocol with the head timeout and the connection cap."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
import uvicorn.config
from starlette.applications import Starlette

from app.plumbing.http_limits import HeaderTimeoutProtocol, uvicorn_limit_concurrency
from cluster import proxy_limits
from config.settings import Settings


def test_an_auto_uvicorn_loads_the_capped_header_timeout_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(uvicorn.config.HTTP_PROTOCOLS, "auto", uvicorn.config.HTTP_PROTOCOLS["auto"])
    monkeypatch.setattr(proxy_limits, "PROXY_PROTOCOL", None)
    settings = Settings(http_header_timeout_s=3.5, max_connections=7)
    hook = proxy_limits.runtime_env(settings)["worker_process_setup_hook"]

    hook()
    config = uvicorn.Config(Starlette(), lifespan="off")  # what Serve's proxy builds: no `http`
    config.load()
    protocol = config.http_protocol_class

    assert isinstance(protocol, type) and issubclass(protocol, HeaderTimeoutProtocol)
    assert protocol.header_timeout_s == 3.5
    loop = asyncio.new_event_loop()  # uvicorn asks for the current one, which an earlier test may have closed
    try:
        instance = protocol(config=config, server_state=uvicorn.server.ServerState(), app_state={},  # type: ignore[call-arg]
                            _loop=loop)
    finally:
        loop.close()
    assert instance.limit_concurrency == uvicorn_limit_concurrency(7)
