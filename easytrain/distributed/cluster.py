"""Starting or joining Ray.

The driver joins the cluster named by ``ray.address`` (or ``RAY_ADDRESS``, as
Ray's own tools do). Without one, Ray's rule applies: it joins the cluster a
``ray start`` left on this machine, else starts a local Ray; ``local`` always
starts a new local Ray (as ``ray.init(address="local")`` does). Ray's token
authentication (on by default in Ray 2.60) is left as Ray sets it up.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

from easytrain.config.derived import needs_reference
from easytrain.config.errors import ConfigError
from easytrain.config.schema import Config, RayConfig
from easytrain.distributed.token import InsecureAddress, check_token_transport

logger = logging.getLogger(__name__)

LOCAL = "local"


def ray_address(cfg: RayConfig) -> tuple[Optional[str], str]:
    """The address the driver joins and the key it came from (``ray.address``, else ``RAY_ADDRESS``);
    ``(None, ...)`` when easytrain starts the Ray (no address, or ``local``)."""
    address, source = (cfg.address, "ray.address") if cfg.address else (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")
    return (None if not address or address == LOCAL else address), source


def check_local_gpus(config: Config) -> None:
    """``trainer.device=cuda`` on a Ray that easytrain starts here: this machine must have a GPU per worker of the
    node (``trainer.workers_per_node``), else a config error now, naming both numbers, rather than a pool that
    waits for devices that never come. A joined cluster is checked by :func:`check_cluster_fits` once Ray is
    up."""
    t = config.trainer
    if t.device != "cuda" or ray_address(config.ray)[0]:
        return
    import torch

    gpus = torch.cuda.device_count()
    if gpus < t.workers_per_node or t.nnodes > 1:
        raise ConfigError("trainer.workers_per_node", t.workers_per_node,
                          f"needs {t.workers_per_node} CUDA GPU(s) per node x trainer.nnodes={t.nnodes}, and the Ray "
                          f"easytrain starts here has this machine's {gpus}",
                          f"set trainer.workers_per_node<={gpus} and trainer.nnodes=1, trainer.device=cpu, or join a "
                          "GPU cluster (ray.address)" if gpus else
                          "install a CUDA build of torch on a GPU machine (bash scripts/install.sh gpu), use "
                          "trainer.device=cpu, or join a GPU cluster (ray.address)")


def pools_per_node(config: Config) -> int:
    """Worker pools the run places on each node: one when colocated (or SFT), else actor, rollout and reference."""
    if config.trainer.task == "sft" or config.trainer.colocate:
        return 1
    return 3 if needs_reference(config) else 2


def places(capacities: list[float], workers_per_node: int, pools: int) -> int:
    """How many (pool, node) places nodes of these capacities hold, a pool taking ``workers_per_node`` devices of
    a node and never two places on one node: a node of capacity c holds min(c // workers_per_node, pools). The
    pools fit on ``nnodes`` distinct nodes each exactly when this reaches ``pools * nnodes`` (fill the places
    pool by pool, node by node, round robin)."""
    return sum(min(int(c // workers_per_node), pools) for c in capacities)


def check_cluster_fits(config: Config, poll_s: float = 2.0) -> None:
    """The Ray just started or joined must hold every worker pool: ``trainer.workers_per_node`` GPUs (CPUs on a
    CPU run) on each of ``trainer.nnodes`` distinct nodes per pool. Else a config error in seconds naming both
    numbers, rather than pools that wait for devices that never come. A joined cluster with an autoscaler may
    get ``ray.wait_for_nodes_s`` seconds to add the nodes first."""
    import ray

    t = config.trainer
    pools = pools_per_node(config)
    key = "GPU" if t.device == "cuda" else "CPU"
    joined = ray_address(config.ray)[0] is not None
    deadline = time.monotonic() + (config.ray.wait_for_nodes_s if joined else 0)
    while True:
        capacities = [n.get("Resources", {}).get(key, 0.0) for n in ray.nodes() if n.get("Alive")]
        held = places(capacities, t.workers_per_node, pools)
        if held >= pools * t.nnodes:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    where = "the cluster" if joined else "the local Ray easytrain started"
    what = f"each of the run's {pools} worker pools needs" if pools > 1 else "the run needs"
    fixes = ["lower trainer.workers_per_node"] + (["set trainer.colocate=true"] if pools > 1 else [])
    fixes += (["add nodes, or give an autoscaler ray.wait_for_nodes_s to add them"] if joined else
              [] if t.device == "cuda" else ["raise ray.num_cpus (Ray's CPUs are logical)"])
    raise ConfigError("trainer.workers_per_node", t.workers_per_node,
                      f"{what} {t.workers_per_node} {key}(s) on each of trainer.nnodes={t.nnodes} node(s), and "
                      f"{where} has {len(capacities)} node(s) with {', '.join(f'{c:g}' for c in capacities)} {key}(s): "
                      f"room for {held} of the {pools * t.nnodes} pool-node places", ", ".join(fixes))


def check_client_address(address: str, source: str) -> None:
    """A Ray Client address (``ray://HOST:10001``) that is not this machine gets the Ray token only over TLS
    (``RAY_USE_TLS=1``) or with ``EASYTRAIN_INSECURE_HTTP=1``: else a config error naming ``source``. A bare
    ``HOST:PORT`` (GCS) or ``auto`` is left alone: joining that way makes this process part of the cluster's own
    network, on which every node already exchanges the same token (and Ray Jobs starts its drivers with
    RAY_ADDRESS set to the head's node IP)."""
    if not address.startswith("ray://"):
        return
    tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
    try:
        check_token_transport(address, source, encrypted=tls,
                              opt_in="set RAY_USE_TLS=1 with Ray's TLS set up, or EASYTRAIN_INSECURE_HTTP=1")
    except InsecureAddress as err:
        raise ConfigError(source, address, str(err), "") from None


def init_ray(cfg: RayConfig, namespace: str = "easytrain") -> dict[str, Any]:
    """Connect to (or start) Ray; returns the cluster's total resources."""
    import ray

    dashboard = ""
    if not ray.is_initialized():
        address, source = ray_address(cfg)
        if address:
            check_client_address(address, source)
            logger.info("joining the Ray cluster at %s", address)
            context = ray.init(address=address, namespace=namespace, log_to_driver=True)
        else:
            fresh = (cfg.address or os.environ.get("RAY_ADDRESS")) == LOCAL
            logger.info("starting a local Ray (num_cpus=%s)%s", cfg.num_cpus or "all",
                        "" if fresh else ", or joining the one `ray start` left on this machine")
            context = ray.init(address=LOCAL if fresh else None, num_cpus=cfg.num_cpus,
                               include_dashboard=cfg.include_dashboard, namespace=namespace, log_to_driver=True)
        dashboard = context.dashboard_url or ""
    resources = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    logger.info("Ray: %d node(s), %s CPU, %s GPU%s", len(nodes), resources.get("CPU", 0),
                resources.get("GPU", 0), f"; dashboard http://{dashboard}" if dashboard else "")
    return dict(resources)
