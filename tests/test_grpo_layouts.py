"""Role layouts: each role in its own resource pool (trainer.colocate=false) runs a full GRPO step."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray

from easytrain.config import load
from easytrain.main import run

pytestmark = pytest.mark.slow


def test_separate_pools_run_a_step(ray_local: None, tmp_path: Path) -> None:
    config = load([f"trainer.output_dir={tmp_path}", "trainer.colocate=false", "trainer.max_steps=1",
                   "data.num_workers=0", "data.synthetic_size=16", "data.synthetic_val_size=4",
                   "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=2",
                   "worker.actor.micro_batch_size_per_device_for_update=2", "data.max_response_length=4"])
    before = ray.available_resources().get("CPU", 0)
    final = run(config)
    assert "val/reward/mean" in final
    step = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
            if '"reward/mean"' in line]
    assert len(step) == 1 and step[0]["time/ref"] > 0 and step[0]["time/update"] > 0
    deadline = time.monotonic() + 30  # placement groups are removed asynchronously
    while ray.available_resources().get("CPU", 0) < before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) >= before  # every pool was released
