"""trainer.threads_per_worker: a worker process computes on its share of the node's cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from easytrain.config import load
from easytrain.workers.base import WorkerBase, node_cpus, worker_threads


def cores() -> int:
    """The node's share base: the cores this process may use (fewer if a Ray started here says so)."""
    count = node_cpus()
    assert 1 <= count <= len(os.sched_getaffinity(0))  # a larger logical Ray count never adds cores
    return count


@pytest.mark.parametrize("overrides, expected", [
    (["trainer.workers_per_node=1"], lambda c: c),
    (["trainer.workers_per_node=2"], lambda c: max(1, c // 2)),
    (["trainer.workers_per_node=1", "trainer.colocate=false"], lambda c: max(1, c // 3)),
    (["trainer.workers_per_node=16", "worker.actor.micro_batch_size_per_device_for_update=2"],
     lambda c: max(1, c // 16)),  # never below one thread
    (["trainer.threads_per_worker=3"], lambda c: 3),
])
def test_share_of_the_node(overrides: list[str], expected, tmp_path: Path) -> None:
    config = load([f"trainer.output_dir={tmp_path}", *overrides])
    assert worker_threads(config) == expected(cores())


def test_worker_sets_its_threads(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    try:
        WorkerBase(load([f"trainer.output_dir={tmp_path}", "trainer.threads_per_worker=1"]), role="actor", rank=0,
                   world_size=1)
        assert torch.get_num_threads() == 1
        WorkerBase(load([f"trainer.output_dir={tmp_path}", "trainer.workers_per_node=1"]), role="actor", rank=0,
                   world_size=1)
        assert torch.get_num_threads() == cores()
    finally:
        torch.set_num_threads(before)


CLUSTER_PROBE = """
import ray
from ray.cluster_utils import Cluster
from easytrain.workers.base import node_cpus

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
for _ in range(3):
    cluster.add_node(num_cpus=2)
ray.init(address=cluster.address)
cluster.wait_for_nodes()
print("THREADS", ray.get(ray.remote(num_cpus=1)(node_cpus).remote()))
ray.shutdown()
cluster.shutdown()
"""


def test_ray_nodes_on_one_machine_split_its_cores(ray_two_nodes) -> None:
    """Two Ray node processes on this machine (the multi-node fixture): a node's workers get the machine's cores
    divided between the nodes, not the node's logical CPU count (2 each)."""
    import ray

    threads = ray.get(ray.remote(num_cpus=1)(node_cpus).remote())
    assert threads == max(1, len(os.sched_getaffinity(0)) // 2)
