"""The reward workers score a step's responses while the driver runs the reference pass: neither waits for the
other (issue 27). The reward function here cannot finish before the reference pass has: it waits for a gate the
driver opens only after that pass, so a driver that collected the scores first would wait out the reward's
own deadline and get scores of -1 (no clocks compared: the order is forced)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from easytrain.distributed.batch import Batch
from easytrain.trainer.rl import RLTrainer
from grpo_helpers import make_config

pytestmark = pytest.mark.slow

GATED_REWARD = '''
import time
from pathlib import Path

GATE = Path({gate!r})


def gated(responses, ground_truths):
    deadline = time.monotonic() + 60
    while not GATE.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    score = 1.0 if GATE.exists() else -1.0
    return [{{"overall": score}} for _ in responses]
'''


class GateAfterReference(RLTrainer):
    """The real trainer; it opens the gate once its reference pass has returned."""

    gate: Path

    def with_reference(self, batch: Batch, timer: Any) -> Batch:
        assert not self.gate.exists()
        batch = super().with_reference(batch, timer)
        self.gate.touch()
        return batch


def test_rewards_are_scored_while_the_reference_pass_runs(ray_local: None, tmp_path: Path) -> None:
    gate = tmp_path / "reference_done"
    reward = tmp_path / "gated_reward.py"
    reward.write_text(GATED_REWARD.format(gate=str(gate)))
    config = make_config(str(tmp_path / "run"), f"reward.function={reward}:gated", "reward.num_workers=1",
                         "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.01", "trainer.val_freq=-1",
                         "trainer.val_before_train=false", "trainer.save_freq=0")
    GateAfterReference.gate = gate
    trainer = GateAfterReference(config)
    try:
        assert trainer.roles.reference is not None
        trainer.step = 1
        metrics = trainer.train_step().metrics
    finally:
        trainer.close()
    assert gate.exists()
    assert metrics["reward/mean"] == 1.0 and metrics["reward/error_rate"] == 0.0, metrics
    assert "time/ref" in metrics and "time/reward" in metrics
