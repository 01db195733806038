"""GRPO learns the image task: the default run (``python -m easytrain.main`` as it ships, conftest's
``default_run``) ends well above the best constant answer on held-out images.

The task is the synthetic colour question about an image ("What colour is the
square?"): four balanced classes, so always giving the most common answer
scores 1/4, and the answer is only in the pixels (the prompt's text is the same
for every colour). A randomly initialised tiny Qwen2.5-VL must first learn to
answer with a colour word at all, then to read the colour from the image.
``bench/default_run.py`` runs the same for 1 and 2 workers and three seeds.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from easytrain.config import load
from easytrain.config.loader import with_default_preset
from easytrain.data.synthetic import ensure_synthetic

pytestmark = pytest.mark.slow


def held_out_constant() -> float:
    """The best constant answer's accuracy on the default run's held-out split (checked to be a fair test)."""
    config = load(with_default_preset([]))  # what the run used, as main does: its held-out split is this file
    d = config.data
    val_file = ensure_synthetic("shapes/colour", "val", d.synthetic_val_size, config.trainer.seed,
                                d.synthetic_difficulty, cache_dir=config.model.cache_dir)
    rows = pq.read_table(val_file).to_pylist()
    answers = Counter(r["answer"] for r in rows)
    best_constant = max(answers.values()) / sum(answers.values())
    assert len(answers) == 4 and best_constant == pytest.approx(0.25, abs=0.05)
    assert all(r["images"] for r in rows)  # the image form, not the text one
    assert len({r["problem"].replace("circle", "X").replace("square", "X").replace("triangle", "X")
                for r in rows}) == 1  # the words never give the colour away
    return best_constant


def assert_learned(run_dir: Path) -> None:
    best_constant = held_out_constant()
    curve = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val/reward/mean"]) for r in curve if "val/reward/mean" in r]
    assert val[0][0] == 0 and val[0][1] <= best_constant + 1e-9  # before training: no better than a constant
    assert val[-1][1] >= 0.9, val


def test_the_default_run_learns_to_read_the_colour_from_the_image(default_run: Path) -> None:
    assert_learned(default_run)


@pytest.mark.parametrize("family", ["qwen3_vl", "internvl", "gemma3"])
def test_other_families_learn_the_default_task(family: str, tmp_path: Path) -> None:
    """Issue 33: ``python -m easytrain.main model.path=tiny:<family>``, everything else as the default run."""
    from conftest import run_main

    assert_learned(run_main(tmp_path / "run", f"model.path=tiny:{family}"))
