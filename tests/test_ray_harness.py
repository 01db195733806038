"""The Ray fixtures every later test builds on, and joining a cluster by address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from easytrain.config import ConfigError
from easytrain.distributed.batch import Batch
from easytrain.distributed.group import Dispatch, WorkerGroup, dispatch
from easytrain.distributed.resources import ResourcePool
from easytrain.memory.flag import MemoryStop


def test_local_ray_runs_tasks(ray_local: None) -> None:
    import ray

    @ray.remote(num_cpus=1)
    def where() -> int:
        return os.getpid()

    pids = ray.get([where.remote() for _ in range(4)])
    assert all(pid != os.getpid() for pid in pids)
    assert ray.cluster_resources()["CPU"] == 8


@pytest.mark.slow
def test_two_node_cluster_spreads_work(ray_two_nodes) -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2

    @ray.remote(num_cpus=1)
    def node_id() -> str:
        return ray.get_runtime_context().get_node_id()

    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    ray.get(group.ready(), timeout=60)
    try:
        ids = ray.get([
            node_id.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i)).remote()
            for i in range(2)])
    finally:
        remove_placement_group(group)
    assert len(set(ids)) == 2 and set(ids) == {n["NodeID"] for n in nodes}


@pytest.mark.slow
def test_init_ray_joins_the_cluster_at_ray_address(ray_two_nodes) -> None:
    script = (
        "import json, logging\n"
        "from easytrain.config.schema import RayConfig\n"
        "from easytrain.distributed.cluster import init_ray\n"
        "import ray\n"
        "init_ray(RayConfig())\n"
        "print(json.dumps(len([n for n in ray.nodes() if n['Alive']])))\n"
    )
    env = dict(os.environ, RAY_ADDRESS=ray_two_nodes.address)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == 2


class Echo:
    """A minimal worker: reports which rank handled which samples."""

    def __init__(self, *, role: str, rank: int, world_size: int) -> None:
        self.rank = rank

    @dispatch(Dispatch.SCATTER)
    def handle(self, batch: Batch) -> Batch:
        ids = batch["ids"].repeat_interleave(2)  # two results per sample, like n responses per prompt
        return Batch({"ids": ids, "rank": torch.full_like(ids, self.rank)})

    @dispatch(Dispatch.BROADCAST)
    def generate_under_pressure(self) -> int:
        """Rank 1 stops as an engine does that read the hard flag; the others answer."""
        if self.rank == 1:
            raise MemoryStop("node test RAM at 99.0% (hard threshold) (during generation)")
        return self.rank

    @dispatch(Dispatch.BROADCAST)
    def load_model_from(self, folder: str) -> None:
        """What a role's setup does with model.path."""
        from easytrain.config.schema import ModelConfig
        from easytrain.models.hf import load_model

        load_model(ModelConfig(path=folder))


@pytest.fixture
def echo_importable() -> None:
    """Ray workers cannot import test modules; ship this one by value."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.parametrize("block", [1, 2, 4])
@pytest.mark.usefixtures("echo_importable")
def test_blocks_of_ranks_share_a_chunk_and_the_leader_answers(ray_local: None, block: int) -> None:
    """Tensor-parallel engines: every rank of a block gets the same prompts, the block leader's result is
    kept, and uneven batches are padded and unpadded per block."""
    pool = ResourcePool(f"echo{block}", 1, 4, "cpu", cpus_per_worker=0.25)
    group = WorkerGroup(Echo, "echo", pool, num_cpus=0.25, num_gpus=0, block_size=block)
    try:
        for n in (8, 5):
            out = group.call("handle", Batch({"ids": torch.arange(n)}))
            assert out["ids"].tolist() == torch.arange(n).repeat_interleave(2).tolist()
            leaders = sorted(set(out["rank"].tolist()))
            assert leaders == list(range(0, 4, block))[:len(leaders)] and all(r % block == 0 for r in leaders)
        with pytest.raises(ValueError, match="do not tile"):
            WorkerGroup(Echo, "echo", pool, num_cpus=0.25, num_gpus=0, block_size=3)
    finally:
        group.shutdown()
        pool.release()


@pytest.mark.usefixtures("echo_importable")
def test_a_worker_that_stops_on_memory_pressure_reaches_the_driver_as_a_memory_stop(ray_local: None) -> None:
    """Not a worker error (which would fail the run): the driver ends the step and saves (issue 24, item 6)."""
    pool = ResourcePool("pressure", 1, 2, "cpu", cpus_per_worker=0.25)
    group = WorkerGroup(Echo, "echo", pool, num_cpus=0.25, num_gpus=0)
    try:
        with pytest.raises(MemoryStop) as stopped:
            group.call("generate_under_pressure")
        assert stopped.value.reason == "node test RAM at 99.0% (hard threshold) (during generation)"
    finally:
        group.shutdown()
        pool.release()


@pytest.mark.usefixtures("echo_importable")
def test_a_model_a_worker_cannot_load_reaches_the_driver_as_one_line_naming_model_path(
        ray_local: None, tmp_path: Path) -> None:
    """Issue 25 item 1: a folder with a config.json but no weights passes validation; the load in the worker fails,
    and the driver gets the config error itself (main prints it in one line, exit 2), not a worker traceback."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    pool = ResourcePool("badmodel", 1, 2, "cpu", cpus_per_worker=0.25)
    group = WorkerGroup(Echo, "echo", pool, num_cpus=0.25, num_gpus=0)
    try:
        with pytest.raises(ConfigError) as failed:
            group.call("load_model_from", str(tmp_path))
        message = str(failed.value)
        assert message.startswith(f"model.path={str(tmp_path)!r}: the model could not be loaded (OSError: "), message
        assert "\n" not in message and failed.value.key == "model.path"
    finally:
        group.shutdown()
        pool.release()
