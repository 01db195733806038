"""The same actor update on one rank and on two FSDP ranks spread over the 2-node test cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easytrain.distributed.batch import Batch
from easytrain.distributed.group import WorkerGroup
from easytrain.distributed.resources import ResourcePool
from easytrain.trainer.data import RLData
from easytrain.workers.actor import ActorWorker
from easytrain.workers.rollout.worker import RolloutWorker

from grpo_helpers import make_config

pytestmark = pytest.mark.slow


def test_update_across_two_nodes_equals_one_rank(ray_two_nodes, tmp_path: Path) -> None:
    config = make_config(str(tmp_path), "algorithm.kl_coef=0", "trainer.nnodes=2", "trainer.workers_per_node=1")
    data = RLData(config)
    spread = ResourcePool("spread", 2, 1, "cpu")
    assert len({p.node_id for p in spread.placements}) == 2  # one rank per node
    single = ResourcePool("single", 1, 1, "cpu")
    rollout = WorkerGroup(RolloutWorker, "rollout", single, num_cpus=0.5, num_gpus=0, init_args=(config,))
    two = WorkerGroup(ActorWorker, "actor", spread, num_cpus=1, num_gpus=0, init_args=(config,))
    one = WorkerGroup(ActorWorker, "actor", single, num_cpus=0.5, num_gpus=0, init_args=(config,))
    try:
        rollout.call("setup")
        for group in (two, one):
            group.init_process_group()
            group.call("setup", 10)
        batch = rollout.call("generate", next(data.train_batches()), 0)
        advantages = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
        batch = batch.union(Batch({"advantages": advantages}))
        results = {}
        for name, group in (("one", one), ("two", two)):
            per_step = config.worker.actor.global_batch_size * config.worker.rollout.n
            ordered = batch.interleave_for_ranks(per_step, group.world_size)
            group.call("update", ordered, 0.0)
            results[name] = group.call("full_state_dict")
    finally:
        for group in (rollout, two, one):
            group.shutdown()
        spread.release()
        single.release()
    for name, value in results["one"].items():
        assert torch.allclose(value, results["two"][name], atol=2e-6, rtol=1e-4), name
