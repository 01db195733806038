"""Two nodes of the test cluster: the same actor update on one rank and on two FSDP ranks across nodes;
checkpoints written by both nodes, and a node lost mid-run recovered exactly."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from easytrain.distributed.batch import Batch
from easytrain.distributed.group import WorkerGroup
from easytrain.distributed.resources import ResourcePool
from easytrain.trainer.data import RLData
from easytrain.workers.actor import ActorWorker
from easytrain.workers.rollout.worker import RolloutWorker

from grpo_helpers import generate, make_config, trained_weights, update

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
        batch = generate(rollout, next(data.train_batches()), 0, config)
        advantages = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
        batch = batch.union(Batch({"advantages": advantages}))
        results = {}
        for name, group in (("one", one), ("two", two)):
            update(group, batch, config, 0.0)
            results[name] = group.call("full_state_dict")
    finally:
        for group in (rollout, two, one):
            group.shutdown()
        spread.release()
        single.release()
    for name, value in results["one"].items():
        assert torch.allclose(value, results["two"][name], atol=2e-6, rtol=1e-4), name


def test_checkpoints_span_nodes_and_a_lost_node_is_recovered_exactly(ray_two_nodes, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Both nodes write their ranks' shards into one checkpoint; removing the worker node mid-run (and
    adding a fresh one, as KubeRay would) ends with the uninterrupted run's weights and data order."""
    reward = Path(__file__).parent / "assets" / "spread_reward.py"

    def run(folder: Path, *extra: str) -> dict[str, torch.Tensor]:
        config = make_config(str(folder), f"reward.function={reward}:spread", "algorithm.kl_coef=0",
                             "trainer.nnodes=2", "trainer.workers_per_node=1", "trainer.max_steps=4",
                             "trainer.save_freq=1", *extra)
        return trained_weights(config)

    want = run(tmp_path / "whole")
    shards = tmp_path / "whole" / "checkpoints" / "global_step_4" / "actor"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # the memory watchdog: one sampler per node, both nodes and each fused worker's node in memory.jsonl (each
    # device's process hosts actor, reference and rollout)
    memory = [json.loads(line) for line in (tmp_path / "whole" / "memory.jsonl").read_text().splitlines()]
    node_ids = {r["node_id"] for r in memory if r["kind"] == "node"}
    assert node_ids == {n.node_id for n in ray_two_nodes.list_all_nodes()}
    assert set(next(r["nodes"] for r in memory if r["kind"] == "samplers")) == node_ids  # one sampler each
    actor_nodes = {r["rank"]: r["node_id"] for r in memory if r["kind"] == "process" and r["role"] == "worker"}
    assert len(actor_nodes) == 2 and len(set(actor_nodes.values())) == 2

    # Ray starts nodes only from the main thread, so the run goes on in a thread while this one waits for
    # step 2 to be logged, removes the node holding rank 1 and adds a fresh one.
    cluster = ray_two_nodes
    worker_node = next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)
    lost = tmp_path / "lost"
    outcome: dict[str, object] = {}

    def run_in_thread() -> None:
        try:
            outcome["weights"] = run(lost, "trainer.max_failures=1")
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread below
            outcome["error"] = err

    caplog.set_level(logging.INFO, logger="easytrain")
    thread = threading.Thread(target=run_in_thread, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    metrics = lost / "metrics.jsonl"
    while not (metrics.exists() and any(json.loads(line).get("step") == 2
                                        for line in metrics.read_text().splitlines())):
        assert thread.is_alive() and time.monotonic() < deadline, outcome.get("error", "step 2 never logged")
        time.sleep(0.05)
    cluster.remove_node(worker_node)
    cluster.add_node(num_cpus=2)
    thread.join(timeout=600)
    assert not thread.is_alive(), "the run did not finish after the node was replaced"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    recovered = [r.getMessage() for r in caplog.records if "recreating the worker groups" in r.getMessage()]
    assert len(recovered) == 1 and f"on node {worker_node.node_ip_address}" in recovered[0], recovered
    got = outcome["weights"]
    assert isinstance(got, dict)
    order = [json.loads(line)["uids"] for line in (lost / "data_order.jsonl").read_text().splitlines()]
    assert order == [json.loads(line)["uids"] for line in (tmp_path / "whole" / "data_order.jsonl").read_text().splitlines()]
    for name, value in want.items():
        assert torch.allclose(got[name], value, atol=1e-6, rtol=0), name
