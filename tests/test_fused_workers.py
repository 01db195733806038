"""Fused workers: one process per device hosts actor, reference and rollout engine, and the step's phases take
the device in the order easytrain.memory.phases writes down: the engine sleeps before the reference and actor
passes, wakes its weights before the sync and its KV cache before the next generation. The HF engine sleeps
for real on CPU at level 2 (its weights are dropped and refilled by the sync), so the recorded order is the
one a GPU node runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easytrain.trainer.rl import RLTrainer
from easytrain.memory.phases import ORDER
from grpo_helpers import make_config

pytestmark = pytest.mark.slow


def assert_engine_holds_the_actors_weights(trainer: RLTrainer) -> None:
    """The (one) engine's weights equal the actor's, tensor for tensor, by HF name."""
    actor = trainer.roles.actor.call("full_state_dict")
    engine = trainer.roles.rollout.call("engine_weights")[0]
    assert set(engine) == set(actor)
    for name, tensor in actor.items():
        assert torch.equal(engine[name], tensor), name


def test_phase_order_with_a_sleeping_engine(ray_local: None, tmp_path: Path) -> None:
    config = make_config(str(tmp_path), "algorithm.kl_coef=0.01", "algorithm.use_kl_loss=true",
                         "worker.actor.ppo_epochs=2", "worker.rollout.sleep_level=2", "trainer.workers_per_node=2",
                         "trainer.val_freq=-1", "trainer.save_freq=-1")
    trainer = RLTrainer(config)
    try:
        roles = trainer.roles
        assert roles.fused is not None and roles.rollout_sleeps
        assert roles.actor.workers is roles.rollout.workers is roles.ref.workers  # the same processes
        pids = roles.fused.call("process_info")
        assert len({p["pid"] for p in pids}) == roles.fused.world_size == 2
        roles.fused.call("phase_log")  # forget setup and the step-0 validation
        steps = []
        for _ in range(2):
            metrics = trainer.train_step().metrics
            trainer.step += 1
            steps.append([[name for name, _ in log] for log in roles.fused.call("phase_log")])
            assert metrics["memory/worker_sleep_freed_gb_max"] > 0  # the sleep dropped real weights
        first = ["generate", "sleep", "ref", "old_log_probs", "update", "wake_weights", "sync"]
        for rank_events in steps[0]:
            assert rank_events == first
        for rank_events in steps[1]:  # the KV cache wakes before the next generation
            assert rank_events == ["wake_kv"] + first
        assert first == [p for p in ORDER if p in first]  # the driver runs phases.STEP's order
    finally:
        trainer.close()


@pytest.mark.parametrize("lora", [False, True])
def test_sync_refills_dropped_weights(ray_local: None, tmp_path: Path, lora: bool) -> None:
    """After a level-2 sleep and the in-process sync, the engine's weights equal the actor's on both ranks:
    gathered by the process group's all-gather into full tensors (LoRA: merged first) and loaded."""
    adapters = ["model.lora.rank=4", "model.lora.alpha=8"] if lora else []
    config = make_config(str(tmp_path), "trainer.workers_per_node=2", "trainer.val_freq=-1", "trainer.save_freq=-1",
                         "algorithm.kl_coef=0.01", *adapters)
    trainer = RLTrainer(config)
    try:
        synced = trainer.train_step().metrics
        assert synced["sync/in_place"] == 0 and synced["sync/tensors"] > 0 and synced["sync/gather_s"] > 0
        actor = trainer.roles.actor.call("full_state_dict")  # HF names, LoRA merged
        engines = trainer.roles.rollout.call("engine_weights")
        assert len(engines) == 2
        for engine in engines:
            assert set(engine) == set(actor)
            for name, tensor in actor.items():  # the same gather and the same merge (W + s * B @ A) in one process
                assert torch.equal(engine[name], tensor), name
    finally:
        trainer.close()


def test_one_process_syncs_the_whole_model_in_place_without_a_collective(ray_local: None, tmp_path: Path) -> None:
    """Issue 32 item 2: one worker holds the whole actor (one GPU): the engine's weights are overwritten where they
    lie in a few multi-tensor copies, and equal the actor's after a level-2 sleep dropped them."""
    config = make_config(str(tmp_path), "trainer.workers_per_node=1", "trainer.val_freq=-1", "trainer.save_freq=-1",
                         "algorithm.kl_coef=0.01")
    trainer = RLTrainer(config)
    try:
        synced = trainer.train_step().metrics
        assert synced["sync/buckets"] == 1.0 and synced["sync/gather_s"] == 0.0
        assert synced["sync/in_place"] == synced["sync/tensors"] > 0  # every weight overwritten where it lies
        assert_engine_holds_the_actors_weights(trainer)
    finally:
        trainer.close()


@pytest.mark.parametrize("layout, discards", [(["worker.rollout.sleep_level=0"], False),
                                              (["worker.rollout.sleep_level=2"], True),
                                              (["trainer.colocate=false"], False)])
def test_a_frozen_vision_tower_is_synced_once(ray_local: None, tmp_path: Path, layout: list[str],
                                              discards: bool) -> None:
    """``model.freeze_vision_tower``: once the engine holds the tower, a sync sends only the weights that train,
    unless a sleep discarded the engine's weights since (level 2), when every weight goes again; fused (in-process
    sync) and in separate pools (through the object store). Either way the engine's weights equal the actor's
    after the sync."""
    from easytrain.models.hf import load_model
    from easytrain.models.parts import freeze_parts

    config = make_config(str(tmp_path), "trainer.workers_per_node=1", "trainer.val_freq=-1", "trainer.save_freq=-1",
                         "model.freeze_vision_tower=true", *layout)
    model = load_model(config.model)
    freeze_parts(model, True, False, False)
    frozen = sum(not p.requires_grad for p in model.parameters())  # (a tower has no tied weights)
    every = len(model.state_dict())
    assert 0 < frozen < every
    trainer = RLTrainer(config)
    try:
        sent = []
        for _ in range(3):
            sent.append(trainer.train_step().metrics["sync/tensors"])
            trainer.step += 1
        assert sent == ([every] * 3 if discards else [every, every - frozen, every - frozen])
        assert_engine_holds_the_actors_weights(trainer)
    finally:
        trainer.close()
