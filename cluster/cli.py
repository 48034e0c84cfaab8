"""`fairlane serve --replicas N` and `--ray-address`: the flags of the cluster, added to app's serve
command. Ray-free: Ray is imported only when the settings ask for a cluster, so a single-process
`fairlane serve` never loads it."""

from __future__ import annotations

import argparse

from app.plumbing.private_dirs import prepare_data_dirs
from app.process.flags import settings_from_args
from app.process.server import SERVE_FLAG_KEYS, run_serve

CLUSTER_FLAG_KEYS = ("replicas", "ray_address", "cluster_router", "prefill_replicas", "decode_replicas")
ROUTERS = ("prefix_load", "pow2", "prefix_affinity")


def extend_serve_command(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registered after app's commands: adds the cluster flags to `serve` and takes over its handler."""
    parser = subparsers.choices["serve"]
    parser.add_argument("--replicas", type=int,
                        help="engine replicas; more than one serves them on a local Ray instance (Ray Serve)")
    parser.add_argument("--ray-address", help="join this Ray cluster instead of starting a local instance")
    parser.add_argument("--prefill-replicas", type=int,
                        help="disaggregated serving: replicas that compute prompts and hand their KV over "
                             "(with --decode-replicas; --replicas is then unused)")
    parser.add_argument("--decode-replicas", type=int, help="disaggregated serving: replicas that decode")
    parser.add_argument("--router", dest="cluster_router", choices=ROUTERS,
                        help="how the replicas share requests (default prefix_load: cached prefix, then load)")
    parser.set_defaults(handler=run_serve_or_cluster)


def run_serve_or_cluster(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, (*SERVE_FLAG_KEYS, *CLUSTER_FLAG_KEYS))
    if not settings.is_cluster:
        return run_serve(args)
    from cluster.launch import run_cluster  # imports Ray: only for a cluster

    prepare_data_dirs(settings)  # before the replicas' model and compile caches write into ./data
    return run_cluster(settings)
