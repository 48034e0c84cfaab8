"""The single server's connection limits on Ray Serve's HTTP proxy: a deadline on each request head
(slowloris) and a cap on open connections (503 past it). The body timeout and the shutdown 503 live
in the ingress's own app, as on the single server (cluster.ingress).

Serve builds its proxy's uvicorn itself and takes only host, port, keep-alive and TLS for it: no
setting for uvicorn's protocol or `limit_concurrency` (its `HTTPOptions.middlewares` is removed in
2.60). Ray's own setting for code in its worker processes, the runtime environment's
`worker_process_setup_hook`, runs `install_proxy_protocol` in each of them before any actor starts:
it points uvicorn's "auto" HTTP protocol at ours. Of those processes only Serve's proxy runs a
uvicorn. Relies on uvicorn's `config.HTTP_PROTOCOLS` (uvicorn is pinned in pyproject) and on Serve's
proxy leaving `http` at "auto"; the cluster tests check both end to end.
"""

from __future__ import annotations

from typing import Any

import uvicorn.config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.plumbing.http_limits import connection_capped_protocol
from config.settings import Settings

# What uvicorn's "auto" protocol resolves to in this process once installed (uvicorn's protocol
# table takes only import strings).
PROXY_PROTOCOL: type[HttpToolsProtocol] | None = None


def install_proxy_protocol(header_timeout_s: float, max_connections: int) -> None:
    global PROXY_PROTOCOL
    PROXY_PROTOCOL = connection_capped_protocol(header_timeout_s, max_connections)
    uvicorn.config.HTTP_PROTOCOLS["auto"] = f"{__name__}:PROXY_PROTOCOL"


def runtime_env(settings: Settings) -> dict[str, Any]:
    """The Ray job's runtime environment: every worker process installs the limits at its start."""
    header_timeout_s, max_connections = settings.http_header_timeout_s, settings.max_connections

    # A named function, not a partial: Ray exports the hook under its __name__.
    def install_fairlane_proxy_limits() -> None:
        install_proxy_protocol(header_timeout_s, max_connections)

    return {"worker_process_setup_hook": install_fairlane_proxy_limits}
