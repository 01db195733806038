"""Role workers on real Ray with real FSDP2 (gloo): on-policy log-probs, rank-count invariance, offload,
uneven scatter, and worker deaths reported by role, rank and node."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
import ray
import torch

from easytrain.config import Config
from easytrain.distributed.batch import Batch
from easytrain.distributed.group import WorkerError, WorkerGroup
from easytrain.distributed.resources import ResourcePool
from easytrain.trainer.data import RLData
from easytrain.trainer.roles import Roles, build_roles
from easytrain.workers.actor import ActorWorker

from grpo_helpers import generate, log_probs, make_config, update
from tolerance import assert_updates_agree

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(ray_clusters: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    ray_clusters.local()
    config = make_config(str(tmp_path_factory.mktemp("grpo")))
    data = RLData(config)
    roles = build_roles(config, total_optimizer_steps=10)
    prompts = next(data.train_batches())
    rollout = generate(roles.rollout, prompts, 0, config)
    yield {"config": config, "data": data, "roles": roles, "prompts": prompts, "rollout": rollout}
    roles.shutdown()


def test_rollout_batch_is_grouped_and_masked(setup: dict[str, Any]) -> None:
    rollout, prompts = setup["rollout"], setup["prompts"]
    assert len(rollout) == 2 * len(prompts)
    assert rollout.meta["uids"] == [u for u in prompts.meta["uids"] for _ in range(2)]
    mask = rollout["response_mask"]
    # the mask is a prefix of ones: nothing counts after the first EOS
    assert torch.equal(mask, mask.cummin(dim=1).values)
    assert rollout["position_ids"].shape == (3, *rollout["input_ids"].shape)
    assert int(rollout["image_grid_thw"].shape[0]) == len(rollout)  # one image per sample, repeated per response


def test_on_policy_log_probs_match_the_rollout(setup: dict[str, Any]) -> None:
    """The rollout's sampling log-probs equal the actor's recomputation for the same weights (fp32)."""
    rollout = setup["rollout"]
    config = setup["config"]
    actor = log_probs(setup["roles"].actor, "compute_log_probs", rollout, config)
    mask = rollout["response_mask"].bool()
    diff = (actor - rollout["rollout_log_probs"]).abs()[mask]
    assert diff.max() < 2e-4, float(diff.max())
    ref = log_probs(setup["roles"].ref, "compute_ref_log_probs", rollout, config)
    assert (ref - actor).abs()[mask].max() < 2e-4  # the reference starts as the same model


def test_uneven_batches_are_padded_and_unpadded_by_the_group(setup: dict[str, Any]) -> None:
    prompts = setup["prompts"].select([0, 1, 2])
    out = generate(setup["roles"].rollout, prompts, 0, setup["config"])
    assert len(out) == 6 and out.meta["uids"] == [u for u in prompts.meta["uids"] for _ in range(2)]


def _update(group: WorkerGroup, batch: Batch, config: Config) -> dict[str, torch.Tensor]:
    update(group, batch, config, 0.01)
    return group.call("full_state_dict")


def assert_same_update(after_a: dict[str, torch.Tensor], after_b: dict[str, torch.Tensor],
                       before: dict[str, torch.Tensor], config: Config) -> None:
    """One ``update`` call's AdamW steps from ``before`` agree (tests/tolerance.py: the tolerance follows from
    the update's size, with a bounded count of elements whose gradient is rounding noise)."""
    actor = config.worker.actor
    steps = actor.ppo_epochs * (config.data.rollout_batch_size // actor.global_batch_size)
    assert_updates_agree(after_a, after_b, before, lr=actor.optim.lr, steps=steps)


def _train_batch(setup: dict[str, Any]) -> Batch:
    rollout = setup["rollout"]
    ref = Batch({"ref_log_probs": log_probs(setup["roles"].ref, "compute_ref_log_probs", rollout, setup["config"])})
    advantages = torch.linspace(-1, 1, len(rollout))[:, None] * rollout["response_mask"]
    return rollout.union(ref).union(Batch({"advantages": advantages}))


def _actor_group(config: Config, nnodes: int, per_node: int, name: str, setup: bool = True) -> WorkerGroup:
    pool = ResourcePool(name, nnodes, per_node, "cpu")
    group = WorkerGroup(ActorWorker, "actor", pool, num_cpus=1, num_gpus=0, init_args=(config,))
    group.init_process_group()
    if setup:
        group.call("setup", 10)
    return group


def test_update_on_one_rank_equals_two_fsdp_ranks(setup: dict[str, Any]) -> None:
    config, batch = setup["config"], _train_batch(setup)
    two = setup["roles"].actor
    one = _actor_group(config, 1, 1, "one-rank")
    try:
        initial = one.call("full_state_dict")
        after_one = _update(one, batch, config)
        after_two = _update(two, batch, config)
    finally:
        one.shutdown()
        one.pool.release()
    assert_same_update(after_one, after_two, initial, config)


def test_the_update_changes_the_weights_and_syncs_to_the_rollout(setup: dict[str, Any]) -> None:
    roles: Roles = setup["roles"]
    before = roles.actor.call("full_state_dict")
    update(roles.actor, _train_batch(setup), setup["config"], 0.01)
    after = roles.actor.call("full_state_dict")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    synced = roles.transport.sync(roles.actor, roles.rollout)
    assert synced["sync/tensors"] == len(after)
    rollout = generate(roles.rollout, setup["prompts"], 1, setup["config"])
    recomputed = log_probs(roles.actor, "compute_log_probs", rollout, setup["config"])
    mask = rollout["response_mask"].bool()
    assert (recomputed - rollout["rollout_log_probs"]).abs()[mask].max() < 2e-4  # on-policy again after sync


def test_param_offload_gives_the_same_update_and_is_installed(setup: dict[str, Any]) -> None:
    config, batch = setup["config"], _train_batch(setup)
    offloaded_cfg = make_config(config.trainer.output_dir, "worker.actor.offload.params=true")
    plain = _actor_group(config, 1, 2, "plain")
    offloaded = _actor_group(offloaded_cfg, 1, 2, "offloaded")
    try:
        assert {p["offload_policies"][0] for p in offloaded.call("placement")} == {"CPUOffloadPolicy"}
        assert {p["offload_policies"][0] for p in plain.call("placement")} == {"OffloadPolicy"}
        initial = plain.call("full_state_dict")
        assert all(torch.equal(v, initial[k]) for k, v in offloaded.call("full_state_dict").items())
        a = _update(plain, batch, config)
        b = _update(offloaded, batch, offloaded_cfg)
        for place in offloaded.call("placement"):  # between phases the shards and states sit in host memory
            assert place["param_devices"] == ["cpu"] and place["optimizer_state_devices"] == ["cpu"]
    finally:
        for group in (plain, offloaded):
            group.shutdown()
            group.pool.release()
    assert_same_update(b, a, initial, config)


def test_a_dead_worker_is_named(setup: dict[str, Any]) -> None:
    config = setup["config"]
    pool = ResourcePool("doomed", 1, 2, "cpu")
    group = WorkerGroup(ActorWorker, "actor", pool, num_cpus=1, num_gpus=0, init_args=(config,))
    try:
        ray.get([w.node_ip.remote() for w in group.workers])
        ray.kill(group.workers[1])  # asynchronous: a call right after may still reach the live actor
        deadline = time.monotonic() + 30
        with pytest.raises(WorkerError, match=r"actor worker rank 1 on node [\d.]+ died during node_ip"):
            while time.monotonic() < deadline:
                group.call("node_ip")
                time.sleep(0.1)
    finally:
        group.shutdown()
        pool.release()


def test_lora_trains_only_adapters_and_the_reference_is_the_base_model(setup: dict[str, Any]) -> None:
    config = make_config(setup["config"].trainer.output_dir, "model.lora.rank=4", "model.lora.alpha=8")
    rollout = setup["rollout"]  # generated by the initial weights: its log-probs are the base model's
    group = _actor_group(config, 1, 2, "lora", setup=False)
    try:
        sizes = group.call("setup", 10)[0]
        assert 0 < sizes["trainable"] < sizes["total"] / 5
        initial = group.call("full_state_dict")
        batch = rollout.union(Batch({"advantages": torch.linspace(-1, 1, len(rollout))[:, None]
                                     * rollout["response_mask"]}))
        update(group, batch, config, 0.0)
        merged = group.call("full_state_dict")
        reference = log_probs(group, "compute_ref_log_probs", rollout, config)
    finally:
        group.shutdown()
        group.pool.release()
    assert merged.keys() == initial.keys()  # HF names, adapters merged: what the rollout loads
    changed = {k for k in initial if not torch.equal(initial[k], merged[k])}
    assert changed and all(k.endswith("proj.weight") and "language_model" in k for k in changed)
    mask = rollout["response_mask"].bool()
    assert (reference - rollout["rollout_log_probs"]).abs()[mask].max() < 2e-4


def test_reusing_log_probs_on_policy_equals_recomputing_them(setup: dict[str, Any]) -> None:
    """ppo_epochs=1 and one optimizer step per rollout batch: the old-log-prob pass can be skipped."""
    config, batch = setup["config"], _train_batch(setup)
    assert config.worker.actor.ppo_epochs == 1
    assert config.data.rollout_batch_size == config.worker.actor.global_batch_size
    reuse, recompute = _actor_group(config, 1, 1, "reuse"), _actor_group(config, 1, 1, "recompute")
    try:
        initial = reuse.call("full_state_dict")
        old = Batch({"old_log_probs": log_probs(recompute, "compute_log_probs", batch, config)})
        with_pass = _update(recompute, batch.union(old), config)
        without = _update(reuse, batch, config)
    finally:
        for group in (reuse, recompute):
            group.shutdown()
            group.pool.release()
    assert_same_update(without, with_pass, initial, config)


def test_hybrid_sharding_gives_the_same_update(setup: dict[str, Any]) -> None:
    """shard_size=1 on 2 ranks: a (replicate=2, shard=1) mesh, i.e. HSDP; same weights as full sharding."""
    config, batch = setup["config"], _train_batch(setup)
    hybrid_cfg = make_config(config.trainer.output_dir, "worker.actor.fsdp.shard_size=1")
    full, hybrid = _actor_group(config, 1, 2, "full"), _actor_group(hybrid_cfg, 1, 2, "hybrid")
    try:
        initial = full.call("full_state_dict")
        a = _update(full, batch, config)
        b = _update(hybrid, batch, hybrid_cfg)
    finally:
        for group in (full, hybrid):
            group.shutdown()
            group.pool.release()
    assert_same_update(b, a, initial, config)
