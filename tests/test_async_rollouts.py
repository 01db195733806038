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


VIDEOS = ["data.train_files=synthetic:shapes/colour+motion", "data.video_key=videos", "data.video_fps=0.05",
          "data.synthetic_difficulty=0"]
"""Image questions and motion clips in one batch; at 0.05 fps a clip's temporal positions reach past the text
after it, where a continuation's response must be placed as the decode placed it."""


def test_each_token_is_trained_against_the_weights_that_sampled_it(ray_local: None, tmp_path: Path) -> None:
    """Image and video rows whose responses go on across weight syncs: each trained token's ratio log-prob is its
    own version's, recomputed here over the batch the update took."""
    config = make_config(str(tmp_path), *ASYNC, *VIDEOS)
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
    assert any(bool((batch["visual_seconds"] > 0).any()) for batch in updated)  # video rows trained
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


def test_a_bound_that_binds_pauses_generation_and_the_node_stays_under_the_plan(tmp_path: Path) -> None:
    """``python -m easytrain.main`` in async mode, responses of up to 8 tokens generated 2 at a time, with
    trainer.async_queue_gb at one and a half of the default task's step batches (as :func:`group_bound` counts
    them): a batch cannot start while another is unfinished, so calls start no new prompts
    (``rollout/queue_held``), the queue never holds more than its bound, and the run's
    processes (their RSS as the watchdog sampled it, summed at each sampling) stay under the plan's node figure,
    which counts the queue at its bound."""
    import collections
    import json
    import subprocess
    import sys

    from easytrain.config import load
    from easytrain.memory.planner import plan
    from easytrain.trainer.asynchronous import group_bound
    from easytrain.trainer.data import RLData

    base = ["trainer.colocate=false", "trainer.workers_per_node=1", "trainer.rollout_mode=async",
            "trainer.max_steps=6", "trainer.val_before_train=false", "data.max_response_length=8",
            "trainer.async_call_tokens=2", "algorithm.max_staleness=3"]  # two batches may run ahead
    config = load([f"trainer.output_dir={tmp_path / 'probe'}", "+exp=tiny", *base])  # main's default preset
    batch = next(RLData(config).train_batches())
    one = sum(group_bound(batch.select([i]), config.worker.rollout.n, config.data.max_response_length)
              for i in range(len(batch)))
    bound_gb = 1.5 * one / 1e9
    run_dir = tmp_path / "run"
    overrides = [*base, f"trainer.async_queue_gb={bound_gb:.9f}"]
    proc = subprocess.run([sys.executable, "-m", "easytrain.main", *overrides, "ray.include_dashboard=false",
                           f"hydra.run.dir={run_dir}"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "rollout/queue_peak_gb" in r]
    assert len(steps) == 6
    assert max(r["rollout/queue_peak_gb"] for r in steps) <= bound_gb
    assert sum(r["rollout/queue_held"] for r in steps) > 0  # generation paused rather than grow the queue
    samples: dict[float, dict[tuple[str, int], int]] = collections.defaultdict(dict)
    for line in (run_dir / "memory.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "process":
            samples[record["t"] // 0.5][(record["role"], record["rank"])] = record["rss_bytes"]
    processes = max(len(s) for s in samples.values())
    measured = max(sum(s.values()) for s in samples.values() if len(s) == processes)
    planned = plan(load([f"trainer.output_dir={tmp_path / 'probe'}", "+exp=tiny", *overrides])).host_peak
    assert measured <= planned, (measured, planned)


def test_multi_turn_episodes_run_async_with_their_images(ray_local: None, tmp_path: Path) -> None:
    """Multi-turn rollouts (the tools' schemas in the prompts, the real engine, whose random model writes no calls)
    in async mode: the rollout worker sends each finished group back with its visuals, the driver keeps them, and
    every updated batch trains on each prompt's image."""
    tools = Path(__file__).resolve().parent / "assets" / "turn_tools.py"
    config = make_config(str(tmp_path), *ASYNC, "worker.rollout.multi_turn.enable=true",
                         f"worker.rollout.multi_turn.tools=[{tools}:count,{tools}:paint]", "data.max_response_length=16",
                         "trainer.async_call_tokens=5")
    trainer = RecordingTrainer(config)
    try:
        for step in range(1, 4):
            trainer.step = step
            trainer.train_step()
        updated: list[Batch] = trainer.updated  # type: ignore[attr-defined]
    finally:
        trainer.close()
    assert len(updated) == 3
    for batch in updated:
        assert batch.image_counts is not None and batch.image_counts.tolist() == [1] * len(batch)
        assert batch.pixels is not None and "response_attention_mask" in batch
