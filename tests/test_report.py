"""The run report: a synthetic GRPO run folder (and an SFT one) is drawn as non-trivial PNGs, only those with
data, beside the memory timeline, and index.html shows them with the final metrics and the config."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from easytrain.trainer import report
from easytrain.trainer.report import find_config, read_metrics, to_series, write_report
from report_helpers import (CONFIG_YAML, assert_nontrivial_png, grpo_records, image_sources, sft_records,
                            write_run)

GB = 2**30
T0 = 1_700_000_000.0


def memory_records(steps: int = 3) -> list[dict[str, Any]]:
    """A one-node memory.jsonl: thresholds, node and process samples, phases."""
    records: list[dict[str, Any]] = [{"kind": "thresholds", "t": T0, "ram_warn": 0.8, "ram_soft": 0.85,
                                      "ram_hard": 0.92, "ray_kill": 0.95}]
    where = {"node_id": "a1b2c3d4e5f6", "node_ip": "127.0.0.1"}
    for i in range(steps * 10):
        t = T0 + i
        records.append({"kind": "node", "t": t, **where, "ram_used_bytes": (8 + i % 10) * GB,
                        "ram_total_bytes": 32 * GB, "ram_limit_bytes": 32 * GB, "source": "host"})
        records.append({"kind": "process", "t": t, **where, "role": "actor", "rank": 0, "pid": 1,
                        "rss_bytes": (2 + (i % 10) / 5) * GB})
    for step in range(steps):
        records.append({"kind": "phase", "step": step + 1, "name": "generate", "start": T0 + 10 * step,
                        "end": T0 + 10 * step + 4})
    return records


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    run_dir = write_run(tmp_path_factory.mktemp("report") / "grpo_run", grpo_records())
    (run_dir / "memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in memory_records()))
    return run_dir, write_report(run_dir)


def test_grpo_run_gets_a_plot_per_kind_with_data_and_the_memory_timeline(grpo_run: tuple[Path, list[Path]]) -> None:
    run_dir, written = grpo_run
    names = [p.name for p in written]
    assert names == ["reward.png", "response_length.png", "kl.png", "time.png", "memory.png", "index.html"]
    assert not (run_dir / "loss.png").exists()  # a GRPO run logs no loss
    for png in written[:-1]:
        assert_nontrivial_png(png)


def test_index_shows_every_plot_the_final_metrics_and_the_config(grpo_run: tuple[Path, list[Path]]) -> None:
    run_dir, written = grpo_run
    page = (run_dir / "index.html").read_text()
    assert image_sources(page) == [p.name for p in written[:-1]]  # relative paths, every PNG, in order
    assert all((run_dir / src).is_file() for src in image_sources(page))
    assert "<title>easytrain: synthetic_grpo (grpo_run)</title>" in page
    assert f"<pre>{CONFIG_YAML}</pre>" in page and "from config.yaml" in page
    assert "http://" not in page and "https://" not in page and "<script" not in page  # self-contained
    # the final-metrics table: each headline key's last value and its step
    last = {key: value for r in grpo_records() for key, value in r.items()}
    assert f"<tr><td>reward/mean</td><td class=\"num\">{last['reward/mean']:.4g}</td><td class=\"num\">30</td>" in page
    assert f"<td>val/reward/mean</td><td class=\"num\">{last['val/reward/mean']:.4g}</td>" in page
    assert "<td>train/loss</td>" not in page


def test_sft_run_plots_loss_validation_reward_and_phases(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "sft", sft_records())
    written = write_report(run_dir)
    assert [p.name for p in written] == ["reward.png", "loss.png", "time.png", "index.html"]
    for png in written[:-1]:
        assert_nontrivial_png(png)
    page = (run_dir / "index.html").read_text()
    assert "<td>train/loss</td>" in page and "<td>val/loss</td>" in page


def test_a_plot_without_data_any_more_is_removed_and_torn_lines_are_skipped(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    run_dir = write_run(tmp_path / "run", grpo_records(steps=6, val_every=3))
    assert (run_dir / "kl.png") in write_report(run_dir)
    records = [{k: v for k, v in r.items() if not k.startswith("actor/")} for r in grpo_records(steps=6, val_every=3)]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"step": 7, "reward/me'  # killed mid-write
    (run_dir / "metrics.jsonl").write_text(text)
    with caplog.at_level(logging.WARNING):
        written = write_report(run_dir)
    assert "skipped 1 unreadable line" in caplog.text
    assert not (run_dir / "kl.png").exists() and "kl.png" not in (run_dir / "index.html").read_text()
    assert [p.name for p in written] == ["reward.png", "response_length.png", "time.png", "index.html"]


def test_series_keep_the_last_value_of_a_repeated_step_and_drop_non_finite_values(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": NaN}\n{"step": 1, "a": 3.0, "tag": "x"}\n'
                    '{"step": 3, "a": Infinity, "b": true}\n')
    assert to_series(read_metrics(path)) == {"a": [(1, 3.0)]}


def test_config_is_the_run_folders_then_hydras_then_the_latest_checkpoints(tmp_path: Path) -> None:
    for step in (2, 10):
        (tmp_path / "checkpoints" / f"global_step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"global_step_{step}" / "config.yaml").write_text(f"step: {step}\n")
    assert find_config(tmp_path) == tmp_path / "checkpoints" / "global_step_10" / "config.yaml"
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("hydra: composed\n")
    assert find_config(tmp_path) == tmp_path / ".hydra" / "config.yaml"
    (tmp_path / "config.yaml").write_text("resolved: true\n")
    assert find_config(tmp_path) == tmp_path / "config.yaml"


def test_no_metrics_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist"):
        write_report(tmp_path)


def test_the_trainer_writes_the_report_when_it_closes_and_a_failure_is_only_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from easytrain.trainer.base import Trainer

    run_dir = write_run(tmp_path / "run", sft_records(steps=3))
    trainer = SimpleNamespace(config=SimpleNamespace(trainer=SimpleNamespace(output_dir=str(run_dir))))
    Trainer.write_report(trainer)  # type: ignore[arg-type]
    assert (run_dir / "index.html").is_file()

    def broken(run_dir: Path) -> list[Path]:
        raise RuntimeError("no fonts")

    monkeypatch.setattr(report, "write_report", broken)
    with caplog.at_level(logging.WARNING):
        Trainer.write_report(trainer)  # type: ignore[arg-type]
    assert "run report not written: RuntimeError: no fonts" in caplog.text
