"""Ulysses sequence parallelism in whole runs (Ray, 2 CPU workers): GRPO and SFT with ``ulysses_size=2``
(one sequence-parallel group of 2 ranks) give the same step as ``ulysses_size=1`` (2 data-parallel ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from easytrain.config import Config, load
from easytrain.main import run
from easytrain.models.hf import model_folder

from tolerance import assert_updates_agree

pytestmark = pytest.mark.slow
SPREAD = Path(__file__).parent / "assets" / "spread_reward.py"  # rewards that differ within a group


def step_metrics(run_dir: Path) -> list[dict[str, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "actor/grad_norm" in m]


def safetensors_in(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def exported(run_dir: Path) -> dict[str, torch.Tensor]:
    return safetensors_in(run_dir / "hf")


def assert_same_training(configs: dict[int, Config], runs: dict[int, Path], optimizer_steps: int) -> None:
    """Both runs' exported weights are the same AdamW steps from the model they started from (tests/tolerance.py
    derives the tolerance from the update)."""
    before = safetensors_in(Path(model_folder(configs[1].model)))
    actor = configs[1].worker.actor
    assert_updates_agree(exported(runs[2]), exported(runs[1]), before, lr=actor.optim.lr, steps=optimizer_steps)


def test_grpo_step_with_ulysses_equals_data_parallel(ray_local: None, tmp_path: Path) -> None:
    common = ["trainer.max_steps=1", "data.num_workers=0", "data.synthetic_size=16", "data.synthetic_val_size=4",
              "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=2",
              "data.max_response_length=8", "worker.actor.padding_free=true", "data.max_prompt_length=128",
              "worker.actor.max_token_len_per_device=400", "algorithm.kl_coef=0.05", "worker.actor.optim.lr=1e-3",
              "trainer.export_final=true", f"reward.function={SPREAD}:spread",
              "worker.actor.reuse_log_probs_on_policy=false"]
    runs, configs = {}, {}
    for size in (1, 2):
        out = tmp_path / f"sp{size}"
        configs[size] = load([f"trainer.output_dir={out}", *common, f"worker.actor.ulysses_size={size}",
                              f"worker.ref.ulysses_size={size}"])
        run(configs[size])
        runs[size] = out
    one, two = step_metrics(runs[1]), step_metrics(runs[2])
    assert len(one) == len(two) == 1
    assert one[0]["reward/mean"] == two[0]["reward/mean"]  # the same rollout (the rollout role is not split)
    assert one[0]["actor/grad_norm"] > 1e-3  # rewards spread within groups: a real gradient to compare
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-4, abs=1e-6), key
    for metrics in (one[0], two[0]):  # at step 0 the reference, the old log-prob pass and the update agree
        assert abs(metrics["actor/kl_loss"]) < 1e-5 and abs(metrics["actor/ppo_kl"]) < 1e-5
    actor = configs[1].worker.actor  # one step: one epoch over one rollout batch of one global batch
    assert actor.ppo_epochs == 1 and configs[1].data.rollout_batch_size == actor.global_batch_size
    assert_same_training(configs, runs, optimizer_steps=1)


def test_sft_with_ulysses_equals_data_parallel(ray_local: None, tmp_path: Path) -> None:
    common = ["+exp=tiny_sft", "trainer.max_steps=2", "data.synthetic_size=32", "data.synthetic_val_size=4",
              "trainer.val_before_train=false", "trainer.export_final=true"]
    runs, configs = {}, {}
    for size in (1, 2):
        out = tmp_path / f"sp{size}"
        configs[size] = load([f"trainer.output_dir={out}", *common, f"worker.actor.ulysses_size={size}"])
        run(configs[size])
        runs[size] = out
    one, two = step_metrics(runs[1]), step_metrics(runs[2])
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        for key in ("train/loss", "actor/grad_norm", "train/trained_tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key
    assert_same_training(configs, runs, optimizer_steps=len(one))  # SFT: one optimizer step per step
