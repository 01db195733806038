"""``data.val_files=null``: no validation data means no validation, anywhere (issue 24, item 8).

Before, a GRPO run trained to its end and then crashed in the final validation (``AssertionError: no validation
data (data.val_files)``). Now it validates nowhere, asked to (``trainer.val_freq``) or not, and ends normally."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from easytrain.trainer.rl import RLTrainer
from grpo_helpers import make_config

pytestmark = pytest.mark.slow


def test_a_run_without_validation_data_trains_to_its_end(ray_local: None, tmp_path: Path) -> None:
    config = make_config(str(tmp_path), "data.val_files=null", "trainer.max_steps=2", "trainer.val_freq=1",
                         "trainer.save_freq=-1", "trainer.workers_per_node=1")
    trainer = RLTrainer(config)
    try:
        assert trainer.fit() == {}
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert not any(key.startswith("val/") for r in rows for key in r)
