"""Starting or joining Ray.

The driver joins the cluster named by ``ray.address`` (or ``RAY_ADDRESS``, as
Ray's own tools do) and otherwise starts a local Ray on this machine. Ray's
token authentication (on by default in Ray 2.60) is left as Ray sets it up.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from easytrain.config.schema import Config, RayConfig
from easytrain.config.validate import ConfigError

logger = logging.getLogger(__name__)


def check_local_gpus(config: Config) -> None:
    """``trainer.device=cuda`` on a Ray that easytrain starts here: this machine must have a GPU per worker of the
    node (``trainer.workers_per_node``), else a config error now, naming both numbers, rather than a pool that
    waits for devices that never come. A joined cluster is checked by :func:`warn_small_nodes` (an autoscaler
    may still add nodes)."""
    t = config.trainer
    if t.device != "cuda" or config.ray.address or os.environ.get("RAY_ADDRESS"):
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


def warn_small_nodes(config: Config) -> None:
    """On a joined cluster, say when no alive node has the GPUs (CPUs on a CPU run) of ``workers_per_node``
    workers: the pools will wait for a node that fits, which only an autoscaler can add."""
    import ray

    t = config.trainer
    key, need = ("GPU", t.workers_per_node) if t.device == "cuda" else ("CPU", t.workers_per_node)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fitting = [n for n in nodes if n.get("Resources", {}).get(key, 0) >= need]
    if len(fitting) < t.nnodes:
        most = max((n.get("Resources", {}).get(key, 0) for n in nodes), default=0)
        logger.warning("trainer.workers_per_node=%d x trainer.nnodes=%d needs %d %s(s) on each of %d node(s); %d "
                       "of the cluster's %d node(s) have that many (the largest has %g): the worker pools will wait "
                       "until an autoscaler adds nodes that fit", need, t.nnodes, need, key, t.nnodes, len(fitting),
                       len(nodes), most)


def init_ray(cfg: RayConfig, namespace: str = "easytrain") -> dict[str, Any]:
    """Connect to (or start) Ray; returns the cluster's total resources."""
    import ray

    dashboard = ""
    if not ray.is_initialized():
        address = cfg.address or os.environ.get("RAY_ADDRESS")
        if address:
            logger.info("joining the Ray cluster at %s", address)
            context = ray.init(address=address, namespace=namespace, log_to_driver=True)
        else:
            logger.info("starting a local Ray (num_cpus=%s)", cfg.num_cpus or "all")
            context = ray.init(num_cpus=cfg.num_cpus, include_dashboard=cfg.include_dashboard,
                               namespace=namespace, log_to_driver=True)
        dashboard = context.dashboard_url or ""
    resources = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    logger.info("Ray: %d node(s), %s CPU, %s GPU%s", len(nodes), resources.get("CPU", 0),
                resources.get("GPU", 0), f"; dashboard http://{dashboard}" if dashboard else "")
    return dict(resources)
