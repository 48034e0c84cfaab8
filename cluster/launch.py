"""`fairlane serve --replicas N` (or `--ray-address`): Ray, Serve's HTTP proxy, the board, N engine
replicas and the ingress, until SIGTERM or Ctrl-C.

Everything binds to loopback unless told otherwise: a local Ray instance gets node address
127.0.0.1 (Ray would pick the machine's interface address), each replica's gRPC server binds to its
node's address (cluster.addresses), Serve's proxy listens on `settings.host` with the single
server's HTTP limits (cluster.proxy_limits), and the dashboard stays off.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from ray import serve
from ray._private import ray_constants
from ray.serve.config import RequestRouterConfig

from cluster import proxy_limits
from cluster.addresses import log_joined_cluster_addresses
from cluster.ingress import OpenAIIngress
from cluster.placement import gpu_share
from cluster.replica import EngineReplica, ReplicaRole
from cluster.service import ClusterBoard
from config.settings import Settings
from tenancy.tenants import load_tenants

logger = logging.getLogger(__name__)

APP_NAME = "fairlane"
# Ray's own routers, by setting value; ours is cluster.router.PrefixLoadRouter. PrefixCacheAffinityRouter is
# named by its defining module: its public re-export (ray.serve.llm) pulls in pyarrow through ray[llm].
ROUTER_CLASSES = {
    "prefix_load": "cluster.router.PrefixLoadRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter",
    "prefix_affinity": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router."
                       "PrefixCacheAffinityRouter",
}
HEALTH_CHECK_PERIOD_S = 2.0
# A stopping deployment's replicas finish their calls within this; the ingress ends its own streams first.
GRACEFUL_SHUTDOWN_S = 5.0
# The ingress's drain gives running requests the grace period, then ends the rest: this bounds the ending.
DRAIN_MARGIN_S = 10.0
OBJECT_STORE_BYTES = 256 * 1024 * 1024  # token events are small; Ray's default takes 30% of RAM


@dataclass(slots=True, frozen=True)
class RunningCluster:
    url: str  # the OpenAI API's base, e.g. http://127.0.0.1:8000
    shutdown_grace_s: float  # what the ingress's drain gives running requests

    def stop(self) -> None:
        """Drain the ingress as the single server drains (503 with Retry-After for new requests while
        running ones finish), then take Serve and Ray down."""
        try:
            serve.get_app_handle(APP_NAME).drain.remote().result(timeout_s=self.shutdown_grace_s + DRAIN_MARGIN_S)
        except Exception:  # a dead or stuck ingress must not keep the cluster up
            logger.warning("the ingress did not drain; stopping anyway", exc_info=True)
        serve.shutdown()
        ray.shutdown()


def with_absolute_paths(settings: Settings) -> Settings:
    """Replicas and the ingress run in Ray's worker processes: relative paths mean the launcher's."""
    update: dict[str, Any] = {"model_cache_dir": str(Path(settings.model_cache_dir).resolve()),
                              "batch_db_path": str(Path(settings.batch_db_path).resolve())}
    if settings.tenants_file is not None:
        update["tenants_file"] = str(Path(settings.tenants_file).resolve())
    if settings.kv_handoff_path is not None:
        update["kv_handoff_path"] = str(Path(settings.kv_handoff_path).resolve())
    if settings.kv_disk_cache_path is not None:
        update["kv_disk_cache_path"] = str(Path(settings.kv_disk_cache_path).resolve())
    if Path(settings.model).exists():
        update["model"] = str(Path(settings.model).resolve())
    return settings.model_copy(update=update)


def pin_ray_to_loopback() -> None:
    """Ray turns a node address of 127.0.0.1 into the machine's interface address (so other nodes can
    reach it) and binds its servers there, unless its single-machine mode is on: the one Ray uses on
    macOS and Windows, for the same reason of not listening where others can connect. Its processes
    read the switch from the environment at start, this one from the constant."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def start_ray(settings: Settings) -> None:
    if settings.ray_address is not None:
        ray.init(address=settings.ray_address, runtime_env=proxy_limits.runtime_env(settings),
                 logging_level=logging.WARNING)
        log_joined_cluster_addresses(settings.host, settings.port)
        return
    pin_ray_to_loopback()
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             runtime_env=proxy_limits.runtime_env(settings),
             object_store_memory=OBJECT_STORE_BYTES, logging_level=logging.WARNING)


def router_config(settings: Settings) -> RequestRouterConfig:
    kwargs = ({"max_imbalance": settings.router_max_imbalance, "max_kv_use": settings.router_max_kv_use}
              if settings.cluster_router == "prefix_load" else {})
    config: dict[str, Any] = {"request_router_class": ROUTER_CLASSES[settings.cluster_router],
                              "request_router_kwargs": kwargs,
                              "request_routing_stats_period_s": settings.cluster_stats_period_s}
    return RequestRouterConfig(**config)


def engine_deployment(settings: Settings, name: str, num_replicas: int, num_gpus: float, board: Any,
                      role: ReplicaRole) -> Any:
    return serve.deployment(
        name=name, num_replicas=num_replicas,
        ray_actor_options={"num_cpus": 0, "num_gpus": num_gpus},
        max_ongoing_requests=settings.max_queued_requests, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        request_router_config=router_config(settings),
    )(EngineReplica).bind(settings.for_role(role), board, role)


def build_application(settings: Settings) -> Any:
    """The Serve application: the ingress bound to the replicas and the board. Disaggregated, the
    "engine" deployment holds the decode replicas and a "prefill" deployment the prefill replicas."""
    board = ray.remote(ClusterBoard).options(num_cpus=0).remote()
    ingress = serve.deployment(name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=settings.max_connections,
                               graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S)(OpenAIIngress)
    visible_gpus = ray.cluster_resources().get("GPU", 0)
    if not settings.is_disaggregated:
        gpus = gpu_share(visible_gpus, settings.replicas, settings.device)
        engines = engine_deployment(settings, "engine", settings.replicas, gpus, board, "colocated")
        return ingress.bind(settings, engines, board)
    gpus = gpu_share(visible_gpus, settings.prefill_replicas + settings.decode_replicas, settings.device)
    decode = engine_deployment(settings, "engine", settings.decode_replicas, gpus, board, "decode")
    prefill = engine_deployment(settings, "prefill", settings.prefill_replicas, gpus, board, "prefill")
    return ingress.bind(settings, decode, board, prefill)


def start_cluster(settings: Settings) -> RunningCluster:
    """Start (or join) Ray, then Serve and the application; returns once every replica is ready."""
    settings = with_absolute_paths(settings)
    if settings.tenants_file is not None:
        load_tenants(settings.tenants_file)  # a bad tenants file stops start-up here, not in every replica
    start_ray(settings)
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port, "location": "HeadOnly"})
        serve.run(build_application(settings), name=APP_NAME, route_prefix="/")
    except BaseException:
        serve.shutdown()
        ray.shutdown()
        raise
    return RunningCluster(f"http://{settings.host}:{settings.port}", settings.shutdown_grace_s)


def run_cluster(settings: Settings) -> int:
    """Serve until SIGTERM or Ctrl-C, then take everything down."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    cluster = start_cluster(settings)
    # After Ray's start: ray.init installs a SIGTERM handler of its own for the driver.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if settings.is_disaggregated:
        logger.info("serving %s disaggregated, %d prefill and %d decode replicas, at %s", settings.model,
                    settings.prefill_replicas, settings.decode_replicas, cluster.url)
    else:
        logger.info("serving %d replicas of %s at %s", settings.replicas, settings.model, cluster.url)
    try:
        stop.wait()
    finally:
        cluster.stop()
    return 0
