"""The fault-injection suite (issue 24): one trial of each fault that no other test injects, on real runs of
``python -m easytrain.main`` (tests/fault_harness.py; bench/faults.py repeats them, with random moments, into
bench/results/faults.json). Killed drivers (one while a checkpoint is written) and fused workers, SIGTERM, a lost
node, ``easytrain stop`` and a corrupt checkpoint are in tests/test_resume.py, test_grpo_two_nodes.py,
test_submit.py and test_corrupt_checkpoint.py. Two pairs of faults share a run, where they do not meet: the faulty
rewards and the removed training file; the rollout and the reward worker kills, one after the other."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import fault_harness as fh
from resume_harness import run_in_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(uninterrupted_run: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's uninterrupted run (the harness settings with the pressure tests' watchdog settings, which
    change no numerics) is the reference of the default settings and of the in-step pressure trial."""
    reference, _ = uninterrupted_run
    fh.REFERENCES[()] = reference
    fh.REFERENCES[fh.MEMORY_WATCH] = reference
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def separate_pools_reference(work: Path, ray_clusters: Any) -> None:
    """The uninterrupted run in the separate-pools layout, the reference of the rollout and reward worker kills:
    made by a trainer in this process on the shared local Ray (resume_harness.run_in_process: the command's steps,
    data order and weights, without a process and a Ray of its own)."""
    ray_clusters.local()
    fh.REFERENCES[fh.SEPARATE_POOLS] = run_in_process(work / "reference-separate-pools", *fh.SEPARATE_POOLS)


@pytest.fixture(scope="module")
def sft_reference(work: Path, ray_clusters: Any) -> None:
    """The same for the SFT preset at the harness's size (fault_harness.SFT_ARGS)."""
    ray_clusters.local()
    fh.REFERENCES[tuple(fh.SFT_ARGS)] = run_in_process(work / "reference-sft", *fh.SFT_ARGS)


def assert_recovered(outcome: fh.Outcome, steps_lost: int = 1) -> None:
    assert outcome.recovered and not outcome.data_lost and outcome.steps_lost <= steps_lost, outcome


def test_memory_rising_inside_a_step_is_stopped_before_rays_monitor_kills(work: Path) -> None:
    """Item 6: with Ray's memory monitor armed at a line the growing reward worker crosses, the run without a
    watchdog is killed by Ray; with it, the step is stopped in its reward phase, the step before is saved (0
    steps lost) and the same command ends as the uninterrupted run."""
    control = fh.memory_in_step(work, "memory-control", random.Random(1), control=True)
    assert control.detail["exit_codes"][0] != 0 and control.detail["killed_by_ray"], control
    outcome = fh.memory_in_step(work, "memory", random.Random(2))
    assert_recovered(outcome, steps_lost=0)
    (step, phase), = outcome.detail["caught_at"]
    assert step == outcome.detail["grow_at_step"] and phase == "reward", outcome


def test_a_full_disk_during_a_save_is_one_line_and_the_checkpoint_before_is_intact(work: Path) -> None:
    outcome = fh.full_disk(work, "full-disk")
    if outcome is None:
        pytest.skip("mounting a small tmpfs needs root")
    assert_recovered(outcome)
    assert "no space left" in outcome.detail["one_line_error"] and outcome.detail["latest_when_full"], outcome


@pytest.fixture(scope="module")
def faulty_run(work: Path) -> fh.Outcome:
    """One run for two faults: the reward function raises, hangs, returns NaN (one per step from step 3 on), and
    the training file it reads (a parquet copy of the prompts) is removed after step 2."""
    return fh.faulty_reward(work, ("raises", "hangs", "nan"), "rewards", remove_data=True)


def test_a_reward_that_raises_hangs_or_is_nan_costs_those_scores_only(faulty_run: fh.Outcome) -> None:
    assert_recovered(faulty_run, steps_lost=0)


def test_killed_rollout_and_reward_workers_are_recovered_inside_the_run(work: Path,
                                                                     separate_pools_reference: None) -> None:
    """One run in the separate-pools layout (where the rollout has processes of its own), trainer.max_failures=2:
    a rollout worker killed after step 2 and, once the run has recovered, a reward worker after step 4."""
    rollout, reward = fh.kill_in_turn(work, (("rollout", 2), ("reward", 4)), 0.2, "workers-killed")
    assert_recovered(rollout)
    assert_recovered(reward)


def test_an_sft_run_recovers_from_a_killed_worker(work: Path, sft_reference: None) -> None:
    """(A killed SFT driver: bench/faults.py.)"""
    assert_recovered(fh.kill(work, "actor", 3, 0.2, "sft-worker", *fh.SFT_ARGS))


def test_the_training_file_removed_mid_run_changes_nothing(faulty_run: fh.Outcome, work: Path) -> None:
    assert faulty_run.detail["train_file_removed_after_step"] == 2 and not (work / "rewards.parquet").exists()
    assert_recovered(faulty_run, steps_lost=0)
