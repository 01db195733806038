"""Starting or joining Ray.

The driver joins the cluster named by ``ray.address`` (or ``RAY_ADDRESS``, as
Ray's own tools do) and otherwise starts a local Ray on this machine. Ray's
token authentication (on by default in Ray 2.60) is left as Ray sets it up.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from easytrain.config.schema import RayConfig

logger = logging.getLogger(__name__)


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
