"""Resource pools place one bundle per device: rank i on bundle i, one distinct (logical) GPU per rank, ranks
ordered by node and local index, and separate pools on disjoint devices. Ray's logical GPUs stand in for real
ones: the probe actors ask for ``num_gpus=1`` and only read ``ray.get_gpu_ids()``."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from easytrain.distributed import resources
from easytrain.distributed.resources import ResourceError, ResourcePool

CPUS_PER_WORKER = 0.1


class Probe:
    def where(self) -> tuple[list[Any], str]:
        import ray

        return ray.get_gpu_ids(), ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module", autouse=True)
def probe_importable() -> None:
    """Ray workers cannot import test modules; ship this one by value."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def where(pool: ResourcePool) -> list[tuple[list[Any], str]]:
    """(GPU ids, node id) of one probe actor per rank, in rank order."""
    import ray

    probe = ray.remote(Probe)
    actors = [probe.options(num_gpus=1, num_cpus=CPUS_PER_WORKER, scheduling_strategy=pool.strategy(rank))
              .remote() for rank in range(pool.world_size)]
    try:
        return ray.get([a.where.remote() for a in actors], timeout=120)
    finally:
        for actor in actors:
            ray.kill(actor)


def node_order() -> list[str]:
    import ray

    alive = [n for n in ray.nodes() if n["Alive"]]
    return [n["NodeID"] for n in sorted(alive, key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))]


def no_pool_groups_left() -> bool:
    from ray.util.placement_group import placement_group_table

    return all(g["state"] == "REMOVED" for g in placement_group_table().values()
               if g["name"].startswith("easytrain-"))


def test_one_pool_one_gpu_per_rank_on_its_bundle(eight_gpus: None) -> None:
    pool = ResourcePool("eight", 1, 8, "cuda", cpus_per_worker=CPUS_PER_WORKER)
    try:
        assert pool.bundle == {"CPU": CPUS_PER_WORKER, "GPU": 1.0}
        assert len(pool.group.bundle_specs) == 8
        assert [(p.rank, p.local_rank, p.bundle_index) for p in pool.placements] == [(i, i, i) for i in range(8)]
        seen = where(pool)
    finally:
        pool.release()
    gpus = [ids for ids, _ in seen]
    assert all(len(ids) == 1 for ids in gpus), gpus
    assert len({ids[0] for ids in gpus}) == 8, gpus
    assert no_pool_groups_left()


def test_two_pools_on_one_node_get_disjoint_gpus(eight_gpus: None) -> None:
    first = ResourcePool("first", 1, 4, "cuda", cpus_per_worker=CPUS_PER_WORKER)
    second = ResourcePool("second", 1, 4, "cuda", cpus_per_worker=CPUS_PER_WORKER)
    try:
        a = [ids[0] for ids, _ in where(first)]
        b = [ids[0] for ids, _ in where(second)]
    finally:
        first.release()
        second.release()
    assert len(set(a)) == 4 and len(set(b)) == 4, (a, b)
    assert not set(a) & set(b), (a, b)


def test_a_pool_that_cannot_fit_names_itself_and_leaves_nothing(eight_gpus: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resources, "READY_TIMEOUT_S", 2)
    for nnodes, per_node in ((1, 9), (2, 4)):  # one node: too many GPUs; two nodes: the probe cannot spread
        with pytest.raises(ResourceError, match=rf"pool 'toobig{nnodes}'.*trainer.nnodes={nnodes}"):
            ResourcePool(f"toobig{nnodes}", nnodes, per_node, "cuda", cpus_per_worker=CPUS_PER_WORKER)
    assert no_pool_groups_left()
    fits = ResourcePool("fits", 1, 8, "cuda", cpus_per_worker=CPUS_PER_WORKER)  # everything was given back
    fits.release()


@pytest.mark.slow
def test_pools_across_two_nodes(two_gpu_nodes: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = node_order()
    assert len(nodes) == 2
    pool = ResourcePool("wide", 2, 4, "cuda", cpus_per_worker=CPUS_PER_WORKER)
    try:
        assert [p.bundle_index for p in pool.placements] == list(range(8))
        assert [p.node_id for p in pool.placements] == [nodes[0]] * 4 + [nodes[1]] * 4
        assert [p.local_rank for p in pool.placements] == [0, 1, 2, 3] * 2
        seen = where(pool)
    finally:
        pool.release()
    assert [node for _, node in seen] == [nodes[0]] * 4 + [nodes[1]] * 4  # ranks 0-3 on node 0, 4-7 on node 1
    for k in range(2):
        ids = [ids[0] for ids, _ in seen[4 * k:4 * k + 4]]
        assert all(len(i) == 1 for i, _ in seen) and len(set(ids)) == 4, seen

    first = ResourcePool("left", 2, 2, "cuda", cpus_per_worker=CPUS_PER_WORKER)
    second = ResourcePool("right", 2, 2, "cuda", cpus_per_worker=CPUS_PER_WORKER)
    try:
        a, b = where(first), where(second)
    finally:
        first.release()
        second.release()
    for pool_seen in (a, b):
        assert [node for _, node in pool_seen] == [nodes[0]] * 2 + [nodes[1]] * 2
    for node in nodes:
        on_a = [ids[0] for ids, n in a if n == node]
        on_b = [ids[0] for ids, n in b if n == node]
        assert len(set(on_a)) == 2 and len(set(on_b)) == 2 and not set(on_a) & set(on_b), (node, a, b)

    monkeypatch.setattr(resources, "READY_TIMEOUT_S", 2)
    with pytest.raises(ResourceError, match="pool 'crowded'"):  # 5 GPUs per node do not fit
        ResourcePool("crowded", 2, 5, "cuda", cpus_per_worker=CPUS_PER_WORKER)
    with pytest.raises(ResourceError, match="pool 'three'"):
        ResourcePool("three", 3, 1, "cuda", cpus_per_worker=CPUS_PER_WORKER)
    monkeypatch.setattr(resources, "NODE_ID_LABEL", "easytrain/no-such-label")
    with pytest.raises(ResourceError, match="pool 'unlabelled'"):  # the probe fits, the pinned group does not
        ResourcePool("unlabelled", 2, 2, "cuda", cpus_per_worker=CPUS_PER_WORKER)
    assert no_pool_groups_left()
