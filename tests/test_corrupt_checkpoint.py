"""Checkpoints that cannot be used (issue 24, items 2 and 4). Every published checkpoint carries a manifest of
the files each rank wrote and their sizes, checked by the driver before publishing (a rank's files it does not
see, as on nodes without shared storage, are never published) and by every resume:

- a shard cut short (a full disk): the checkpoint is incomplete; ``trainer.resume=auto`` takes the newest complete
  one before it and says so, naming it in ``trainer.resume=<that folder>`` is a one-line error naming the newest
  complete one;
- a shard of the right size that does not load (garbage): the run falls back the same way after the failed load;
- a folder the driver does not see a rank's files in: not published, one line saying why.

Before, each of these ended in a distributed-checkpoint traceback, or published a checkpoint missing shards."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from easytrain.trainer.checkpoint import CheckpointError, check_written, missing_files
from easytrain.trainer.rl import RLTrainer
from grpo_helpers import make_config

BASE = ["trainer.workers_per_node=1", "trainer.val_freq=-1", "trainer.save_freq=1"]


def shards(step: Path) -> list[Path]:
    found = sorted((step / "actor").rglob("*.distcp"))
    assert found, f"no shard files under {step}"
    return found


def train(tmp_path: Path, steps: int) -> None:
    trainer = RLTrainer(make_config(str(tmp_path), *BASE, f"trainer.max_steps={steps}"))
    try:
        trainer.fit()
    finally:
        trainer.close()


def warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.fixture(scope="module")
def trained(ray_clusters: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 2 steps with a checkpoint after each, made once: each test damages its own copy."""
    ray_clusters.local()
    run = tmp_path_factory.mktemp("corrupt") / "run"
    train(run, 2)
    return run


@pytest.mark.slow
def test_damaged_latest_checkpoints_fall_back_to_the_one_before(ray_local: None, trained: Path, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    step1, step2 = tmp_path / "checkpoints" / "global_step_1", tmp_path / "checkpoints" / "global_step_2"
    assert not missing_files(step2) and (step2 / "manifest.json").is_file()
    shard = shards(step2)[0]
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 3])  # cut short: the manifest says so before any load
    assert missing_files(step2) == [str(shard.relative_to(step2))]
    with pytest.raises(CheckpointError, match=r"global_step_2: incomplete checkpoint \(1 file\(s\) missing or cut "
                                              rf"short, .*\); the newest complete one is {step1}"):
        RLTrainer(make_config(str(tmp_path), *BASE, "trainer.max_steps=3", f"trainer.resume={step2}"))
    caplog.set_level(logging.WARNING)
    again = RLTrainer(make_config(str(tmp_path), *BASE, "trainer.max_steps=3"))
    try:
        assert again.step == 1 and warnings(caplog, "not a complete checkpoint; using the newest complete one")
    finally:
        again.close()

    shard.write_bytes(bytes(len(whole)))  # the right size, unreadable: found only by loading it
    assert not missing_files(step2)
    caplog.clear()
    again = RLTrainer(make_config(str(tmp_path), *BASE, "trainer.max_steps=3"))
    try:
        assert again.step == 1
        warned = warnings(caplog, "could not be loaded")
        assert len(warned) == 1 and f"resuming from {step1}" in warned[0]
        again.fit()
        assert again.step == 3
    finally:
        again.close()


@pytest.mark.slow
def test_an_unloadable_only_checkpoint_is_a_one_line_error(ray_local: None, trained: Path, tmp_path: Path) -> None:
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    shutil.rmtree(tmp_path / "checkpoints" / "global_step_2")  # step 1's checkpoint the run's only one
    (tmp_path / "checkpoints" / "latest").write_text("1\n")
    shard = shards(tmp_path / "checkpoints" / "global_step_1")[0]
    shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(CheckpointError, match="no earlier complete checkpoint in the run") as info:
        RLTrainer(make_config(str(tmp_path), *BASE, "trainer.max_steps=2"))
    assert "\n" not in str(info.value)


def test_a_rank_whose_files_the_driver_does_not_see_is_never_published(tmp_path: Path) -> None:
    """What each rank reported writing against what the driver sees: on nodes without shared storage a rank's
    shards land in its own node's copy of the folder."""
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "__0_0.distcp").write_bytes(b"x" * 10)
    seen = [{"rank": 0, "node_ip": "10.0.0.1", "files": {"actor/__0_0.distcp": 10}},
            {"rank": 1, "node_ip": "10.0.0.2", "files": {"actor/__1_0.distcp": 10}}]
    with pytest.raises(CheckpointError, match=r"step 7 is not published: 1 file\(s\) that actor rank 1 wrote on node "
                                              r"10.0.0.2 are not in .* \(e.g. actor/__1_0.distcp\); the run folder "
                                              r"must be on storage every node shares"):
        check_written(tmp_path, 7, seen)
    assert check_written(tmp_path, 7, seen[:1]) == {"actor/__0_0.distcp": 10}
