"""The default run (conftest's ``default_run``), as it ships: TensorBoard event files hold every
step's metrics, every name it logs is in the metric catalog (docs/metrics.md), the run folder keeps its
resolved config, and the report's PNGs (beside memory.png) and index.html are written when the run closes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import DEFAULT_RUN_STEPS as STEPS
from easytrain.trainer.metric_names import is_known
from report_helpers import assert_nontrivial_png, image_sources, read_scalars

pytestmark = pytest.mark.slow


def test_tensorboard_event_files_hold_the_runs_step_metrics(default_run: Path) -> None:
    scalars = read_scalars(default_run / "tensorboard" / "tiny")
    records = [json.loads(line) for line in (default_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "time/generate", "time/update",
                "perf/generate_tokens_per_s"):
        assert [s for s, _ in scalars[key]] == list(range(1, STEPS + 1)), key
        assert [v for _, v in scalars[key]] == pytest.approx([r[key] for r in train], rel=1e-6, abs=1e-6), key
    assert [s for s, _ in scalars["val/reward/mean"]] == list(range(0, STEPS + 1, 32))  # before training, every 32


def test_every_name_the_run_logs_is_in_the_metric_catalog(default_run: Path) -> None:
    records = [json.loads(line) for line in (default_run / "metrics.jsonl").read_text().splitlines()]
    names = {key for record in records for key in record} - {"step"}
    assert {"reward/mean", "time/generate", "val/reward/accuracy", "memory/worker_rss_gb_max"} <= names, names
    unknown = sorted(name for name in names if not is_known(name))
    assert not unknown, (f"logged but not in easytrain/trainer/metric_names.py: {unknown}; add them, then run "
                         "`.venv/bin/python scripts/gen_docs.py`")


def test_the_report_shows_the_runs_plots_and_config(default_run: Path) -> None:
    page = (default_run / "index.html").read_text()
    shown = image_sources(page)
    assert {"reward.png", "response_length.png", "kl.png", "time.png", "memory.png"} <= set(shown), shown
    for name in shown:
        assert_nontrivial_png(default_run / name)
    config = (default_run / "config.yaml").read_text()
    assert "experiment_name: tiny" in config and "total_epochs: 6" in config and "val_freq: 32" in config
    assert "<h1>tiny (run)</h1>" in page and "total_epochs: 6" in page and "<td>reward/mean</td>" in page
