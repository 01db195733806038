"""Resource pools: where each rank of a role runs.

A pool is one Ray placement group with one bundle per node (``STRICT_SPREAD``
across nodes, so bundle i is a whole node's share: ``workers_per_node`` GPUs,
or CPUs here). Ranks are ordered by node (by IP, then node id) and by local
index, so rank r always lands on the same node for the same cluster.
Colocated roles share a pool and take fractions of each bundle; separate
pools give each role its own devices.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120


class ResourceError(RuntimeError):
    """The cluster cannot hold the requested pool."""


@dataclass(frozen=True)
class Placement:
    rank: int
    local_rank: int
    node_id: str
    node_ip: str
    bundle_index: int


class ResourcePool:
    def __init__(self, name: str, nnodes: int, workers_per_node: int, device: str,
                 cpus_per_worker: float = 1.0) -> None:
        self.name, self.nnodes, self.workers_per_node, self.device = name, nnodes, workers_per_node, device
        bundle: dict[str, float] = {"CPU": cpus_per_worker * workers_per_node}
        if device == "cuda":
            bundle["GPU"] = float(workers_per_node)
        self.bundle = bundle
        strategy = "STRICT_SPREAD" if nnodes > 1 else "STRICT_PACK"
        self.group: PlacementGroup = placement_group([dict(bundle) for _ in range(nnodes)], strategy=strategy,
                                                     name=f"easytrain-{name}")
        try:
            ray.get(self.group.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as err:
            remove_placement_group(self.group)
            raise ResourceError(
                f"pool {name!r} needs {nnodes} node(s) with {bundle} free each (trainer.nnodes={nnodes}, "
                f"trainer.workers_per_node={workers_per_node}); the cluster has {ray.available_resources()} "
                f"available on {len([n for n in ray.nodes() if n['Alive']])} node(s)") from err
        self.placements = self._order()

    def _order(self) -> list[Placement]:
        table = placement_group_table(self.group)
        by_bundle = table["bundles_to_node_id"]
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        bundles = sorted(by_bundle, key=lambda b: (ips.get(by_bundle[b], ""), by_bundle[b]))
        placements = []
        for node_rank, bundle in enumerate(bundles):
            node = by_bundle[bundle]
            for local in range(self.workers_per_node):
                placements.append(Placement(node_rank * self.workers_per_node + local, local, node,
                                            ips.get(node, "?"), int(bundle)))
        return placements

    @property
    def world_size(self) -> int:
        return len(self.placements)

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=self.placements[rank].bundle_index)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "bundle": self.bundle, "ranks": [(p.rank, p.node_ip) for p in self.placements]}

    def release(self) -> None:
        remove_placement_group(self.group)
