"""``trainer.rollout_mode=async`` in a run: responses go on across weight syncs, and each update takes its PPO
ratio per token against the log-prob of the weights that sampled that token (computed again here, in this
process, from the actor's weights after each update)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easytrain.distributed.batch import Batch
from grpo_helpers import make_config
from test_one_step_off import SPREAD, RecordingTrainer, log_probs_under

pytestmark = pytest.mark.slow

ASYNC = ["trainer.colocate=false", "trainer.rollout_mode=async", "trainer.workers_per_node=1",
         "trainer.async_call_tokens=3", "algorithm.max_staleness=3", "algorithm.kl_coef=0", "trainer.val_freq=-1",
         "trainer.val_before_train=false", "worker.actor.optim.lr=3e-3", f"reward.function={SPREAD}:spread",
         "trainer.save_freq=0"]
"""Separate pools of one worker each; responses of up to 8 tokens generated 3 at a time, so most span calls
and weight syncs."""


def test_each_token_is_trained_against_the_weights_that_sampled_it(ray_local: None, tmp_path: Path) -> None:
    config = make_config(str(tmp_path), *ASYNC)
    trainer = RecordingTrainer(config)
    try:
        weights = [trainer.roles.actor.call("full_state_dict")]  # weights[v]: after v updates
        metrics = []
        for step in range(1, 6):
            trainer.step = step
            metrics.append(trainer.train_step().metrics)
            weights.append(trainer.roles.actor.call("full_state_dict"))
        updated: list[Batch] = trainer.updated  # type: ignore[attr-defined]
    finally:
        trainer.close()
    spanning = 0
    for step, batch in enumerate(updated, start=1):
        mask = batch["response_mask"].bool()
        versions = batch["token_versions"]
        assert (versions[mask] <= step - 1).all() and (versions[mask] >= 0).all() and (versions[~mask] == -1).all()
        assert batch.image_counts is not None and batch.pixels is not None  # the prompts' images came along
        expected = torch.zeros_like(batch["old_log_probs"])
        for v in versions[mask].unique().tolist():
            under = log_probs_under(config, weights[v], batch)
            expected = torch.where(versions == v, under, expected)
        torch.testing.assert_close(batch["old_log_probs"][mask], expected[mask], rtol=1e-4, atol=1e-4)
        rows = [versions[r][mask[r]].unique() for r in range(len(batch))]
        spanning += sum(len(r) > 1 for r in rows)  # a response sampled under two or more weight versions
        staleness = (step - 1 - versions[mask]).float()
        assert metrics[step - 1]["rollout/staleness"] == pytest.approx(float(staleness.mean()))
        assert metrics[step - 1]["rollout/staleness_max"] == float(staleness.max()) <= 3
    assert spanning > 0  # responses went on across weight syncs
    assert max(m["rollout/staleness_max"] for m in metrics[1:]) >= 1


def test_a_resumed_run_lands_on_the_uninterrupted_runs_weights(ray_local: None, tmp_path: Path) -> None:
    """4 steps straight, against 2 steps, a stop, and a resume for the last 2: the checkpoint holds the queue, the
    engines' unfinished responses and the batch read but not started, so the resumed run trains on what the
    uninterrupted one did and the weights end equal (CPU, fp32)."""
    from grpo_helpers import trained_weights

    common = [*ASYNC[:-1], "trainer.save_freq=1", "data.synthetic_size=16", "trainer.total_epochs=1"]
    straight = trained_weights(make_config(str(tmp_path / "straight"), *common, "trainer.max_steps=4"))
    trained_weights(make_config(str(tmp_path / "resumed"), *common, "trainer.max_steps=2"))
    assert (tmp_path / "resumed" / "checkpoints" / "global_step_2" / "rollout_async.safetensors").is_file()
    resumed = trained_weights(make_config(str(tmp_path / "resumed"), *common, "trainer.max_steps=4",
                                          "trainer.resume=auto"))
    assert straight.keys() == resumed.keys()
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)
