"""``trainer.rollout_mode=one_step_off``: the engine generates the next batch while the actor trains.

The update on batch t must take its PPO ratio against the log-probs of the weights that generated batch t
(those of step t-2, one update behind the actor's), and a run stopped after a step and resumed must train on
the batch the uninterrupted run generated during that step, landing on the same weights (CPU, fp32).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from easytrain.config import Config, ConfigError, load
from easytrain.distributed.batch import Batch
from easytrain.models.hf import load_model, model_folder
from easytrain.trainer.ahead import importance_weights
from easytrain.trainer.rl import RLTrainer
from easytrain.workers.forward import response_log_probs
from grpo_helpers import make_config, trained_weights

pytestmark = pytest.mark.slow

SPREAD = Path(__file__).resolve().parent / "assets" / "spread_reward.py"
OFF = ["trainer.colocate=false", "trainer.rollout_mode=one_step_off", "trainer.workers_per_node=1",
       "algorithm.kl_coef=0", "trainer.val_freq=-1", "trainer.val_before_train=false", "worker.actor.optim.lr=3e-3",
       f"reward.function={SPREAD}:spread"]
"""Separate pools of one worker each (actor, rollout; no reference), and a reward that spreads the scores of a
prompt's responses, so every step moves the weights visibly."""
LEARNED = 0.9
"""Held-out accuracy the one-step-off default task must end at: the sync default's goal (it reached 1.0 here)."""


class RecordingTrainer(RLTrainer):
    """The real trainer; it keeps every batch the update trained on."""

    def update(self, batch: Batch) -> dict[str, float]:
        self.__dict__.setdefault("updated", []).append(batch)
        return super().update(batch)


def log_probs_under(config: Config, weights: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    """The sampled tokens' log-probs (the sampling distribution's) under ``weights``, in this process."""
    model = load_model(config.model, model_folder(config.model), dtype="float32")
    model.load_state_dict(weights)
    model.config.use_cache = False
    with torch.no_grad():
        return response_log_probs(model.eval(), batch, config.worker.rollout.temperature, torch.device("cpu"))[0]


def test_each_update_takes_its_ratio_against_the_weights_that_generated_its_batch(ray_local: None,
                                                                                   tmp_path: Path) -> None:
    config = make_config(str(tmp_path), *OFF, "trainer.save_freq=0")
    trainer = RecordingTrainer(config)
    try:
        weights = [trainer.roles.actor.call("full_state_dict")]  # weights[k]: after k updates
        staleness, gaps = [], []
        for step in range(1, 5):
            trainer.step = step
            metrics = trainer.train_step().metrics
            staleness.append(metrics["rollout/staleness"])
            gaps.append(metrics["actor/ppo_kl"])
            weights.append(trainer.roles.actor.call("full_state_dict"))
        updated: list[Batch] = trainer.updated  # type: ignore[attr-defined]
    finally:
        trainer.close()
    assert staleness == [0.0, 1.0, 1.0, 1.0]  # the first step trains on what it generated; then one update behind
    for step, batch in enumerate(updated, start=1):
        mask = batch["response_mask"].bool()
        generating = weights[max(0, step - 2)]  # step t's batch was generated during step t-1, by its weights
        expected = log_probs_under(config, generating, batch)
        torch.testing.assert_close(batch["old_log_probs"][mask], expected[mask], rtol=0, atol=2e-5)
        if step >= 2:  # the actor's own weights at the update give other log-probs: the test tells them apart
            current = log_probs_under(config, weights[step - 1], batch)
            assert float((current - expected)[mask].abs().max()) > 1e-3
    assert all(abs(g) > 0 for g in gaps[1:])  # the update's start sees the gap to the behaviour policy


def test_truncated_importance_weights() -> None:
    actor = torch.tensor([[-1.0, -2.0, -0.5]])
    engine = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = importance_weights(actor, engine, mask, cap=1.2)
    torch.testing.assert_close(weights, torch.tensor([[1.2, float(torch.tensor(-1.0).exp()), 0.0]]))


@pytest.mark.parametrize("overrides,key", [
    (["trainer.rollout_mode=one_step_off"], "trainer.rollout_mode"),  # colocated roles share the devices
    (["trainer.rollout_mode=one_step_off", "trainer.colocate=false", "algorithm.dynamic_sampling=true"],
     "algorithm.dynamic_sampling"),
    (["trainer.rollout_mode=one_step_off", "trainer.colocate=false", "worker.rollout.top_p=0.9"],
     "trainer.rollout_mode"),
    (["algorithm.tis_cap=2"], "algorithm.tis_cap"),
])
def test_impossible_combinations_are_config_errors(tmp_path: Path, overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load([f"trainer.output_dir={tmp_path}", *overrides])
    assert str(err.value).startswith(key)


def test_a_resumed_run_lands_on_the_uninterrupted_runs_weights(ray_local: None, tmp_path: Path) -> None:
    """4 steps straight, against 2 steps, a stop, and a resume for the last 2: the checkpoint of step 2 carries
    the batch generated during it, so step 3 trains on the same batch and the weights end equal."""
    common = [*OFF, "trainer.save_freq=1", "data.synthetic_size=16", "trainer.total_epochs=1"]
    straight = trained_weights(make_config(str(tmp_path / "straight"), *common, "trainer.max_steps=4"))
    trained_weights(make_config(str(tmp_path / "resumed"), *common, "trainer.max_steps=2"))
    assert (tmp_path / "resumed" / "checkpoints" / "global_step_2" / "rollout_ahead.safetensors").is_file()
    resumed = trained_weights(make_config(str(tmp_path / "resumed"), *common, "trainer.max_steps=4",
                                        "trainer.resume=auto"))
    assert straight.keys() == resumed.keys()
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)


def test_the_default_task_learns_one_step_off(tmp_path: Path) -> None:
    """``python -m easytrain.main`` (the tiny preset's colour question) with a pool per role, one step off, for
    128 of its 192 steps (a constant learning rate: the same first 128 steps): held-out accuracy ends far above
    the best constant answer (1/4), as the sync default's does (the whole run reached 1.0 from step 128 on)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "easytrain.main", "trainer.colocate=false",
                           "trainer.rollout_mode=one_step_off", "trainer.workers_per_node=1",
                           "trainer.max_steps=128", "ray.include_dashboard=false", f"hydra.run.dir={run_dir}"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    staleness = [r["rollout/staleness"] for r in curve if "rollout/staleness" in r]
    assert len(staleness) == 128 and staleness[0] == 0 and set(staleness[1:]) == {1.0}
    val = [r["val/reward/mean"] for r in curve if "val/reward/mean" in r]
    assert val[0] <= 0.25 and val[-1] >= LEARNED, val
