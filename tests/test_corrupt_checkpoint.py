"""A corrupt latest checkpoint (issue 24, item 4): the run resumes from the newest complete one before it and says
so; a checkpoint named by ``trainer.resume`` that cannot be loaded, or one with nothing before it, is a one-line
error naming it. Before, both ended in a distributed-checkpoint traceback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from easytrain.trainer.checkpoint import CheckpointError
from easytrain.trainer.rl import RLTrainer
from grpo_helpers import make_config

pytestmark = pytest.mark.slow
BASE = ["trainer.workers_per_node=1", "trainer.val_freq=-1", "trainer.save_freq=1"]


def truncate_shards(step: Path) -> None:
    shards = sorted((step / "actor").rglob("*.distcp"))
    assert shards, f"no shard files under {step}"
    for shard in shards:
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])  # a save cut short by a full disk


def test_a_corrupt_latest_checkpoint_falls_back_to_the_one_before(ray_local: None, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    first = RLTrainer(make_config(str(tmp_path), *BASE, "trainer.max_steps=2"))
    try:
        first.fit()
    finally:
        first.close()
    step2 = tmp_path / "checkpoints" / "global_step_2"
    truncate_shards(step2)
    with pytest.raises(CheckpointError, match=r"global_step_2 could not be loaded \(.*\); resume from an earlier "
                                              r"one, e.g. trainer.resume=.*global_step_1"):
        RLTrainer(make_config(str(tmp_path), *BASE, "trainer.max_steps=3", f"trainer.resume={step2}"))
    caplog.set_level(logging.WARNING, logger="easytrain.trainer.base")
    again = RLTrainer(make_config(str(tmp_path), *BASE, "trainer.max_steps=3"))
    try:
        assert again.step == 1  # the newest complete checkpoint before the corrupt one
        warned = [r.getMessage() for r in caplog.records if "could not be loaded" in r.getMessage()]
        assert len(warned) == 1 and "resuming from" in warned[0] and "global_step_1" in warned[0]
        again.fit()
        assert again.step == 3
    finally:
        again.close()


def test_a_corrupt_only_checkpoint_is_a_one_line_error(ray_local: None, tmp_path: Path) -> None:
    first = RLTrainer(make_config(str(tmp_path), *BASE, "trainer.max_steps=1"))
    try:
        first.fit()
    finally:
        first.close()
    truncate_shards(tmp_path / "checkpoints" / "global_step_1")
    with pytest.raises(CheckpointError, match="no earlier complete checkpoint in the run") as info:
        RLTrainer(make_config(str(tmp_path), *BASE, "trainer.max_steps=2"))
    assert "\n" not in str(info.value)
