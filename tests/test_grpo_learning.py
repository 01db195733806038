"""GRPO learns: held-out reward rises well above the best constant answer.

The task is the synthetic colour question in its text form ("The picture
shows a green square ... What colour is the square?"): four balanced classes,
so always giving the most common answer scores 1/4, and the right answer
depends on the input. A randomly initialised tiny Qwen2 must first learn to
answer with a colour word at all, then which one. One token per response
keeps the run within CI's budget.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from easytrain.config import load
from easytrain.data.synthetic import ensure_synthetic
from easytrain.main import run

pytestmark = pytest.mark.slow

LEARNING_RUN = [
    "model.path=tiny:qwen2", "data.image_key=null", "data.train_files=synthetic:shapes/colour",
    "data.val_files=synthetic:shapes/colour", "data.synthetic_difficulty=0", "data.max_response_length=1",
    "data.num_workers=0", "data.val_batch_size=-1", "data.rollout_batch_size=16", "worker.rollout.n=16",
    "worker.actor.global_batch_size=16", "worker.actor.micro_batch_size_per_device_for_update=128",
    "worker.actor.optim.lr=1e-3", "algorithm.kl_coef=0", "trainer.total_epochs=100", "trainer.max_steps=250",
    "trainer.val_freq=50", "trainer.val_before_train=true", "trainer.loggers=[jsonl]",
]


def test_grpo_beats_the_best_constant_answer(ray_local: None, tmp_path: Path) -> None:
    config = load([f"trainer.output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}", *LEARNING_RUN])
    val_file = ensure_synthetic("shapes/colour", "val", config.data.synthetic_val_size, config.trainer.seed,
                                0, text_only=True, cache_dir=config.model.cache_dir)
    import pyarrow.parquet as pq

    answers = Counter(pq.read_table(val_file).column("answer").to_pylist())
    best_constant = max(answers.values()) / sum(answers.values())
    assert len(answers) == 4 and best_constant == pytest.approx(0.25, abs=0.05)

    final = run(config)

    curve = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/reward/mean"] for r in curve if "val/reward/mean" in r]
    assert val[0] <= best_constant + 1e-9  # before training: no better than a constant
    assert final["val/reward/mean"] >= best_constant + 0.25, val

    # 250 healthy steps under the memory watchdog's defaults: no pressure, imbalance or leak reported
    memory = [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]
    assert len({r["step"] for r in memory if r["kind"] == "phase"}) == 250
    assert [r for r in memory if r["kind"] == "event"] == []
