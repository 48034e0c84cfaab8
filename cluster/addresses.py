"""Where the cluster's own servers listen, and keeping Serve's replica servers off every interface.

Each Serve replica process (the engines and the ingress) starts a gRPC server for calls between
deployments, which Ray 2.60 binds to `[::]:0`, every interface, with no setting to change it
(`ray.serve._private.replica.ReplicaActor._on_initialized`). Callers reach it at the replica's node
address (`RunningReplicaInfo.node_ip`), so binding it there instead loses nothing: on a local
instance that is 127.0.0.1, on a joined cluster the address Ray's own servers use on that node.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray._common import tls_utils
from ray.serve._private import replica as serve_replica

logger = logging.getLogger(__name__)

EVERY_INTERFACE = "[::]"


def grpc_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def bind_replica_grpc_to_node_address() -> str:
    """Call in a deployment's constructor: Serve starts the replica's gRPC server right after it.
    Returns the host the server will bind."""
    host = grpc_host(ray.util.get_node_ip_address())

    def add_port_on_node_address(server: Any, address: str) -> int:
        bind_host, _, port = address.rpartition(":")
        port_number: int = tls_utils.add_port_to_grpc_server(
            server, f"{host}:{port}" if bind_host == EVERY_INTERFACE else address)
        return port_number

    # Serve's replica module calls the helper by this module-level name when it starts the server.
    setattr(serve_replica, "add_port_to_grpc_server", add_port_on_node_address)  # noqa: B010
    logger.info("this replica's inter-deployment gRPC server binds to %s", host)
    return host


def log_joined_cluster_addresses(proxy_host: str, proxy_port: int) -> None:
    """What a joined cluster binds, as far as this process can tell, for the operator to secure."""
    nodes = [node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")]
    logger.warning(
        "joined an external Ray cluster: Serve's HTTP proxy listens on %s:%d (the OpenAI API); each replica's "
        "gRPC server binds to its node's address; Ray's own servers (GCS, raylets, object managers, workers, "
        "dashboard) listen where that cluster's `ray start` put them, on the node addresses %s. Only the proxy "
        "should be reachable by clients: firewall the rest to the cluster's nodes (docs/cluster.md).",
        proxy_host, proxy_port, ", ".join(sorted(set(nodes))) or "none alive")
