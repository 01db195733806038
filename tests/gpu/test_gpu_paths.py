"""The GPU path on one CUDA device, for a tiny and a ~0.6B random Qwen2.5-VL (bench/planner_model.py): the FSDP2
update over NCCL, the HF engine generating on CUDA, the fused worker's in-process sync (the engine then holds
exactly the actor's weights and its greedy tokens are the actor's), the engine's sleep freeing what it says, and
the watchdog's readings (NVML and the torch allocator) against what torch itself reports.

Marked ``gpu``: skipped without a CUDA device, never run in CI (``pytest -m "not gpu"``). On a GPU machine:
``python -m pytest tests/gpu -m gpu`` (``bench/gpu_smoke.py`` runs it and records the result)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from easytrain.memory.readings import gpu_readings, open_nvml
from easytrain.trainer.rl import RLTrainer
from grpo_helpers import make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.planner_model import HALF_B_TEXT, HALF_B_VISION, bench_model_folder  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

LOG_PROB_TOL = 1e-3
"""fp32 on CUDA, TF32 matmuls off (torch's default): the engine's cached decode and the actor's full forward
differ by kernel choice and summation order only, ~1e-6 relative on logits of order 10; 1e-3 leaves room for
the vocabulary's log-sum-exp and still fails on a wrong weight (an update of lr 1e-3 moves them by more)."""


def _model(size: str) -> list[str]:
    if size == "tiny":
        return []
    folder = bench_model_folder(HALF_B_TEXT, HALF_B_VISION, tag="gpu_half_b", tie=True)
    return [f"model.path={folder}"]


@pytest.fixture(scope="module", params=["tiny", "half_b"])
def trainer(request: pytest.FixtureRequest, ray_clusters: Any,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[RLTrainer]:
    ray_clusters.local()
    config = make_config(str(tmp_path_factory.mktemp(f"gpu-{request.param}")), "trainer.device=cuda",
                         "trainer.workers_per_node=1", "worker.rollout.sleep_level=2", "trainer.val_freq=-1",
                         "trainer.save_freq=-1", "algorithm.kl_coef=0.01", "model.dtype=float32",
                         *_model(request.param))
    trainer = RLTrainer(config)
    try:
        yield trainer
    finally:
        trainer.close()


def _allocated(trainer: RLTrainer) -> int:
    return trainer.roles.fused.call("memory")[0]["watch"]["gpu_allocated_bytes"]


def test_the_fsdp2_update_runs_over_nccl_and_changes_the_weights(trainer: RLTrainer) -> None:
    roles = trainer.roles
    info = roles.fused.call("process_info")[0]
    assert "nccl" in str(info["backend"])
    before = roles.actor.call("full_state_dict")
    metrics = trainer.train_step().metrics
    trainer.step += 1
    after = roles.actor.call("full_state_dict")
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
    assert all(torch.isfinite(t).all() for t in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert metrics["memory/worker_sleep_freed_gb_max"] > 0  # the engine slept on the device during the step


TINY_SDPA_GAP = ("measured on an H200 (torch 2.11+cu130): for the tiny model in float32 the engine's prefill and "
                 "the actor's forward disagree on the first response token by up to 0.6 under SDPA's default CUDA "
                 "kernel, and agree to 5e-7 under its math kernel and under eager attention, the weights being "
                 "equal; the ~0.6B model agrees within 1e-3. Kept as a finding, cause not isolated")


def test_after_the_sync_the_engine_holds_the_actor_and_greedy_is_on_policy(trainer: RLTrainer,
                                                                           request: pytest.FixtureRequest) -> None:
    if "tiny" in request.node.name:
        request.applymarker(pytest.mark.xfail(reason=TINY_SDPA_GAP, strict=False))
    roles = trainer.roles
    prompts = next(trainer.data.train_batches())
    greedy = roles.rollout.call("generate", prompts, trainer.step, True)  # validation sampling: greedy; syncs first
    engine = roles.rollout.call("engine_weights")[0]
    actor = roles.actor.call("full_state_dict")
    assert set(engine) == set(actor)
    for name, tensor in actor.items():
        assert torch.equal(engine[name], tensor.to(engine[name].dtype)), name
    recomputed = trainer.log_probs(roles.actor, "compute_log_probs", greedy)
    mask = greedy["response_mask"].bool()
    assert mask.any()
    gap = (recomputed - greedy["rollout_log_probs"]).abs() * mask
    assert gap.max() < LOG_PROB_TOL, (f"rows' largest gaps {gap.max(1).values.tolist()}, first tokens' "
                                      f"{gap[:, 0].tolist()}, prompt lengths {greedy['attention_mask'].sum(-1).tolist()}")


def test_the_engines_sleep_frees_what_it_says(trainer: RLTrainer) -> None:
    roles = trainer.roles
    roles.rollout.call("generate", next(trainer.data.train_batches()), trainer.step, True)  # awake, weights in
    before = _allocated(trainer)
    freed = roles.rollout.call("sleep")[0]
    after = _allocated(trainer)
    assert freed > 0
    # The drop is at least the weights' bytes and hardly more: the allocator rounds each block up to 512 bytes and
    # a generation's last small tensors may go with them (1.97 MB more than 2.42 GB seen on an H200).
    assert freed <= before - after <= freed * 1.01
    roles.rollout.call("generate", next(trainer.data.train_batches()), trainer.step, True)  # the sync refills it
    assert _allocated(trainer) - after >= freed


def test_the_watchdogs_readings_agree_with_torch(trainer: RLTrainer) -> None:
    nvml = open_nvml()
    assert nvml is not None, "NVML (nvidia-ml-py) is what the watchdog reads GPUs with"
    readings = gpu_readings(nvml)
    assert len(readings) == torch.cuda.device_count() >= 1
    gpu = readings[0]
    # NVML's total is the board's memory; torch's the part CUDA can allocate: equal within the driver's reserve.
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0.95 * gpu["total_bytes"] <= total <= gpu["total_bytes"]
    worker = trainer.roles.fused.call("memory")[0]["watch"]
    assert 0 < worker["gpu_allocated_bytes"] <= worker["gpu_reserved_bytes"] <= gpu["used_bytes"]
    assert worker["gpu_peak_bytes"] >= worker["gpu_allocated_bytes"]


def test_segment_attention_builds_no_sequence_square_on_the_gpu() -> None:
    """The packed samples of a micro batch attended block by block (what the workers run on GPU with sdpa) equal
    the masked call and peak far below it: the masked call holds an S x S mask and SDPA's additive copy of it."""
    from easytrain.models.segments import attend, packed_blocks

    torch.manual_seed(0)
    lengths = [512] * 32  # 16384 tokens: the mask alone is 256 MB of bool
    positions = torch.cat([torch.arange(n) for n in lengths])
    q = torch.randn(1, 8, positions.numel(), 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, positions.numel(), 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).cuda()

    def peak(run: Any) -> tuple[torch.Tensor, int]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = run()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    def masked() -> torch.Tensor:
        mask = (sample[:, None] == sample[None, :]).tril()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    blocked, blocked_peak = peak(lambda: attend(q, k, v, packed_blocks(positions)))
    dense, dense_peak = peak(masked)
    # bf16 outputs of two kernels: a few units of bf16's last place (2^-8 relative) on values of order 1
    torch.testing.assert_close(blocked.float(), dense.float(), rtol=0, atol=2e-2)
    assert blocked_peak * 4 < dense_peak, (blocked_peak, dense_peak)
