"""Where the roles' ranks land, through the same code build_roles and build_sft_roles use (start_groups,
start_sft_group), on Ray's logical GPUs: probe workers stand in for the role workers and report
``ray.get_gpu_ids()``. Fused (colocated) workers: actor, reference and rollout rank i are one process on one
GPU; separate pools: no GPU shared between roles; every rank a distinct GPU within its node."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from easytrain.config import Config, load, with_overrides
from easytrain.trainer.roles import start_groups, start_sft_group

pytestmark = pytest.mark.slow


class ProbeRole:
    def __init__(self, config: Config, *, role: str, rank: int, world_size: int) -> None:
        self.role, self.rank = role, rank

    def where(self) -> tuple[int, tuple[int, ...], str, int]:
        """(rank, GPU ids, node id, pid) of this process."""
        import os

        import ray

        return self.rank, tuple(ray.get_gpu_ids()), ray.get_runtime_context().get_node_id(), os.getpid()


PROBES = {"actor": ProbeRole, "rollout": ProbeRole, "ref": ProbeRole}


@pytest.fixture(scope="module", autouse=True)
def probes_importable() -> None:
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def gpu_config(nnodes: int, per_node: int, *extra: str) -> Config:
    config = load([f"trainer.nnodes={nnodes}", f"trainer.workers_per_node={per_node}", "algorithm.kl_coef=0.01",
                   "data.rollout_batch_size=16", "worker.actor.global_batch_size=16",  # batches that 8 ranks divide
                   "worker.actor.micro_batch_size_per_device_for_update=1",
                   "worker.actor.micro_batch_size_per_device_for_experience=1", *extra])
    return with_overrides(config, {"trainer.device": "cuda"})  # Ray's logical GPUs: the probes never touch CUDA


def placements(config: Config) -> tuple[dict[str, list[Any]], int]:
    """Each role's (rank, GPU ids, node, pid) in rank order, and how many processes the run has."""
    groups, pools, fused = start_groups(config, ProbeRole, PROBES)
    try:
        seen = {role: group.call("where") for role, group in groups.items()}
        processes = len({pid for ranks in seen.values() for *_, pid in ranks})
    finally:
        for group in ([fused] if fused is not None else list(groups.values())):
            group.shutdown()
        for pool in pools:
            pool.release()
    return seen, processes


def assert_distinct_per_node(ranks: list[Any]) -> None:
    by_node: dict[str, list[int]] = {}
    for _, gpus, node, _ in ranks:
        assert len(gpus) == 1, ranks
        by_node.setdefault(node, []).append(gpus[0])
    for node, gpus in by_node.items():
        assert len(set(gpus)) == len(gpus), (node, ranks)


def check(nnodes: int, per_node: int, separate_per_node: int) -> None:
    """Fused and SFT groups on ``per_node`` devices per node; separate pools (three roles) on
    ``separate_per_node`` each."""
    fused, processes = placements(gpu_config(nnodes, per_node))
    world = nnodes * per_node
    assert set(fused) == {"actor", "rollout", "ref"} and processes == world  # one process per device
    for role, ranks in fused.items():
        assert [r for r, *_ in ranks] == list(range(world))
        assert_distinct_per_node(ranks)
        assert [(g, n) for _, g, n, _ in ranks] == [(g, n) for _, g, n, _ in fused["actor"]]  # rank i: same GPU

    separate, processes = placements(gpu_config(nnodes, separate_per_node, "trainer.colocate=false"))
    assert processes == 3 * nnodes * separate_per_node
    devices = {role: {(n, g[0]) for _, g, n, _ in ranks} for role, ranks in separate.items()}
    for role, ranks in separate.items():
        assert_distinct_per_node(ranks)
    assert not devices["actor"] & devices["rollout"] and not devices["actor"] & devices["ref"]
    assert not devices["rollout"] & devices["ref"]

    sft, pool = start_sft_group(gpu_config(nnodes, per_node, "trainer.task=sft"), ProbeRole)
    try:
        ranks = sft.call("where")
    finally:
        sft.shutdown()
        pool.release()
    assert [r for r, *_ in ranks] == list(range(world))
    assert_distinct_per_node(ranks)


def test_roles_on_one_eight_gpu_node(eight_gpus: None) -> None:
    check(1, 8, separate_per_node=2)


def test_roles_on_two_nodes_of_four_gpus(two_gpu_nodes: None) -> None:
    check(2, 4, separate_per_node=1)
