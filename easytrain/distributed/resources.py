"""Resource pools: where each rank of a role runs.

A pool is one Ray placement group with one bundle per device: ``{"GPU": 1,
"CPU": cpus_per_worker}`` on GPU, a CPU share (``{"CPU": cpus_per_worker}``)
per worker on CPU, ``nnodes * workers_per_node`` bundles in all, exactly
``workers_per_node`` of them on each of ``nnodes`` distinct nodes. Rank i of
the role runs on bundle i; ranks are ordered by node (by IP, then node id)
and then by local index, so rank r always lands on the same node for the same
cluster and ranks ``[k * workers_per_node, (k + 1) * workers_per_node)`` share
node k.

On one node the group is ``STRICT_PACK``. Across nodes Ray's strategies alone
cannot promise ``workers_per_node`` per-device bundles on each node (``PACK``
may crowd a node, ``STRICT_SPREAD`` allows one bundle per node), so the nodes
are chosen first by a short-lived probe group (one whole-node share per node,
``STRICT_SPREAD``), which is removed; the real group then pins each bundle to
its node with a ``ray.io/node-id`` label selector.

Colocated roles share one process per device ("fused workers"), so that
process takes the whole bundle; separate pools give each role its own devices
(Ray hands out distinct GPU ids per bundle, so two pools never share one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


READY_TIMEOUT_S = 120
NODE_ID_LABEL = "ray.io/node-id"  # a default label Ray 2.60 gives every node


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
        if nnodes < 1 or workers_per_node < 1:
            raise ValueError(f"pool {name!r}: nnodes={nnodes} and workers_per_node={workers_per_node} must be >= 1")
        self.name, self.nnodes, self.workers_per_node, self.device = name, nnodes, workers_per_node, device
        bundle: dict[str, float] = {"CPU": float(cpus_per_worker)}
        if device == "cuda":
            bundle["GPU"] = 1.0
        self.bundle = bundle
        self.group: Optional[PlacementGroup] = None
        deadline = time.monotonic() + READY_TIMEOUT_S
        probe: Optional[PlacementGroup] = None
        try:
            if nnodes == 1:
                self.group = placement_group([dict(bundle) for _ in range(workers_per_node)],
                                             strategy="STRICT_PACK", name=f"easytrain-{name}")
                self._wait(self.group, deadline)
            else:
                share = {k: v * workers_per_node for k, v in bundle.items()}
                probe = placement_group([dict(share) for _ in range(nnodes)], strategy="STRICT_SPREAD",
                                        name=f"easytrain-{name}-probe")
                self._wait(probe, deadline)
                nodes = self._sorted_nodes(set(placement_group_table(probe)["bundles_to_node_id"].values()))
                remove_placement_group(probe)
                probe = None
                per_node = [node for node in nodes for _ in range(workers_per_node)]  # bundle i = rank i
                self.group = placement_group([dict(bundle) for _ in per_node], strategy="PACK",
                                             name=f"easytrain-{name}",
                                             bundle_label_selector=[{NODE_ID_LABEL: node} for node in per_node])
                self._wait(self.group, deadline)
            self.placements = self._order()
        except BaseException as err:
            for group in (probe, self.group):
                if group is not None:
                    remove_placement_group(group)
            self.group = None
            if isinstance(err, ray.exceptions.GetTimeoutError):
                raise ResourceError(self._unplaceable(READY_TIMEOUT_S)) from err
            raise

    @staticmethod
    def _wait(group: PlacementGroup, deadline: float) -> None:
        ray.get(group.ready(), timeout=max(0.1, deadline - time.monotonic()))

    @staticmethod
    def _node_ips() -> dict[str, str]:
        return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}

    def _sorted_nodes(self, nodes: set[str]) -> list[str]:
        ips = self._node_ips()
        return sorted(nodes, key=lambda node: (ips.get(node, ""), node))

    def _unplaceable(self, timeout: float) -> str:
        alive = [n for n in ray.nodes() if n["Alive"]]
        per_node = "; ".join(f"{n['NodeManagerAddress']}: {n['Resources']}" for n in alive)
        return (f"pool {self.name!r} needs {self.workers_per_node} bundle(s) of {self.bundle} (one per device) on "
                f"each of {self.nnodes} node(s) (trainer.nnodes={self.nnodes}, "
                f"trainer.workers_per_node={self.workers_per_node}); not placed within {timeout} s. The cluster "
                f"has {ray.available_resources()} available on {len(alive)} node(s) (totals: {per_node})")

    def _order(self) -> list[Placement]:
        """Bundle i is rank i: bundles were created node by node in node order (one node: all on it)."""
        assert self.group is not None
        by_bundle = {int(b): node for b, node in placement_group_table(self.group)["bundles_to_node_id"].items()}
        ips = self._node_ips()
        nodes = self._sorted_nodes(set(by_bundle.values()))
        if len(nodes) != self.nnodes or [by_bundle[i] for i in range(len(by_bundle))] != \
                [node for node in nodes for _ in range(self.workers_per_node)]:
            raise RuntimeError(f"pool {self.name!r}: bundles landed as {by_bundle}, expected "
                               f"{self.workers_per_node} per node on nodes {nodes} in order")
        return [Placement(rank, rank % self.workers_per_node, node, ips.get(node, "?"), rank)
                for rank, node in sorted(by_bundle.items())]

    @property
    def world_size(self) -> int:
        return len(self.placements)

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=self.placements[rank].bundle_index)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "bundle": self.bundle, "bundles": self.world_size,
                "nodes": self.nnodes, "workers_per_node": self.workers_per_node,
                "ranks": [(p.rank, p.node_ip, p.node_id[:8]) for p in self.placements]}

    def release(self) -> None:
        if self.group is not None:
            remove_placement_group(self.group)
