"""vLLM's GPU-only paths: sleep mode frees the engine's memory between rollouts and a sync after waking
restores exactly the actor's weights. Skipped without a CUDA GPU (and on this project's CPU machine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.config import load

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_sleep_frees_memory_and_sync_after_wake_restores_the_weights(ray_clusters: Any, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from easytrain.trainer.roles import build_roles
    from easytrain.trainer.data import RLData
    from grpo_helpers import log_probs

    ray_clusters.local()
    config = load([f"trainer.output_dir={tmp_path}", "+exp=tiny_vllm", "trainer.device=cuda",
                   "trainer.workers_per_node=1", "data.rollout_batch_size=4", "worker.rollout.n=2",
                   "worker.actor.global_batch_size=4", "worker.actor.micro_batch_size_per_device_for_update=4",
                   "worker.rollout.gpu_memory_utilization=0.3", "worker.rollout.sleep_level=2",
                   "data.max_response_length=8"])
    roles = build_roles(config, total_optimizer_steps=2)
    try:
        assert roles.rollout_sleeps
        prompts = next(RLData(config).train_batches())
        before = roles.rollout.call("generate", prompts, 0, True)
        freed = roles.rollout.call("sleep")
        assert min(freed) > 0  # level 2 drops weights and KV cache
        roles.transport.sync(roles.actor, roles.rollout)  # wakes the weights, then loads them
        after = roles.rollout.call("generate", prompts, 0, True)  # wakes the KV cache
        assert torch.equal(before["responses"], after["responses"])  # same weights as before the sleep
        recomputed = log_probs(roles.actor, "compute_log_probs", after, config)
        mask = after["response_mask"].bool()
        assert (recomputed - after["rollout_log_probs"]).abs()[mask].max() < 1e-3
    finally:
        roles.shutdown()
