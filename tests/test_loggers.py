"""Metrics loggers (trainer.loggers): TensorBoard event files hold every step's metrics (and a resume purges
what came after its checkpoint), metrics.jsonl as before, added sinks, W&B and MLflow offline when installed,
and validation naming a selected logger whose package is missing."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Optional

import pytest

from easytrain.config import ConfigError, compose
from easytrain.config.validate import LOGGER_PACKAGES, LOGGERS
from easytrain.main import resolve
from easytrain.trainer.loggers import make_sink, mlflow_uri, wandb_mode
from easytrain.trainer.metrics import MetricsLogger
from report_helpers import read_scalars

STEPS = 5


def metrics_of(step: int, shift: float = 0.0) -> dict[str, float]:
    return {"reward/mean": 0.1 * step + shift, "time/generate": 1.0 + step, "actor/kl_loss": 0.01 * step}


def log_steps(logger: MetricsLogger, steps: range, shift: float = 0.0) -> None:
    for step in steps:
        logger.log(step, metrics_of(step, shift))


def test_tensorboard_event_files_hold_every_step_metric(tmp_path: Path) -> None:
    logger = MetricsLogger(str(tmp_path), ["jsonl", "tensorboard"], "tiny")
    log_steps(logger, range(1, STEPS + 1))
    logger.log(STEPS, {"val/reward/mean": 0.7})
    logger.close()
    scalars = read_scalars(tmp_path / "tensorboard" / "tiny")
    assert set(scalars) == {"reward/mean", "time/generate", "actor/kl_loss", "val/reward/mean"}
    for key in ("reward/mean", "time/generate", "actor/kl_loss"):
        assert [s for s, _ in scalars[key]] == list(range(1, STEPS + 1))
        assert [v for _, v in scalars[key]] == pytest.approx([metrics_of(s)[key] for s in range(1, STEPS + 1)])
    assert scalars["val/reward/mean"] == [(STEPS, pytest.approx(0.7))]


def test_a_resume_forgets_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    first = MetricsLogger(str(tmp_path), ["jsonl", "tensorboard"], "tiny")
    first.rewind(0)  # a fresh start rewinds to 0, as Trainer.restore does
    log_steps(first, range(1, STEPS + 1))
    first.close()  # the run died after step 5; its checkpoint is step 3
    second = MetricsLogger(str(tmp_path), ["jsonl", "tensorboard"], "tiny")
    second.rewind(3)
    log_steps(second, range(4, STEPS + 1), shift=10.0)
    second.close()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["reward/mean"] for r in records] == pytest.approx([0.1, 0.2, 0.3, 10.4, 10.5])
    scalars = read_scalars(tmp_path / "tensorboard" / "tiny")
    assert scalars["reward/mean"] == [(s, pytest.approx(v)) for s, v in
                                      [(1, 0.1), (2, 0.2), (3, 0.3), (4, 10.4), (5, 10.5)]]


def test_jsonl_records_and_the_console_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    logger = MetricsLogger(str(tmp_path), ["console", "jsonl"], "tiny")
    with caplog.at_level(logging.INFO, logger="easytrain.metrics"):
        logger.log(1, {"reward/mean": 0.25, "time/generate": 2, "sync/tensors": 57})
    logger.write_samples(1, [{"response": "red"}])
    logger.log_order(1, ["a", "b"])
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward/mean": 0.25,
                                                                    "time/generate": 2.0, "sync/tensors": 57.0}
    assert "step 1: reward/mean=0.25" in caplog.text and "sync/tensors" not in caplog.text
    assert json.loads((tmp_path / "samples.jsonl").read_text()) == {"step": 1, "response": "red"}
    assert not (tmp_path / "tensorboard").exists()


class Recorder:
    """A sink as the Ray metrics one is: log and close, no rewind."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, metrics))

    def close(self) -> None:
        self.closed = True


class Broken(Recorder):
    def close(self) -> None:
        raise OSError("disk gone")


def test_added_sinks_get_every_record_and_closing_goes_on_past_a_failure(tmp_path: Path) -> None:
    logger = MetricsLogger(str(tmp_path), ["jsonl"], "tiny")
    broken, recorder = logger.add(Broken()), logger.add(Recorder())
    logger.rewind(0)  # a sink without rewind is fine
    logger.log(1, {"reward/mean": 1})
    logger.close()
    assert isinstance(recorder, Recorder) and recorder.logged == [(1, {"reward/mean": 1.0})] and recorder.closed
    assert isinstance(broken, Broken) and broken.logged == recorder.logged


def test_every_validated_logger_has_a_sink(tmp_path: Path) -> None:
    for name in LOGGERS:
        if name in LOGGER_PACKAGES and importlib.util.find_spec(LOGGER_PACKAGES[name]) is None:
            continue
        if name in ("wandb", "mlflow"):
            continue  # built in their own tests (they start runs)
        make_sink(name, tmp_path, "easytrain", "tiny", None).close()
    with pytest.raises(ValueError, match="unknown logger"):
        make_sink("neptune", tmp_path, "easytrain", "tiny", None)


def test_tensorboard_is_on_by_default() -> None:
    config = resolve(compose(["trainer.output_dir=/tmp/easytrain-test-out"]))
    assert config.trainer.loggers == ["console", "jsonl", "tensorboard"]


@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard"])
def test_a_selected_logger_whose_package_is_missing_is_a_config_error(name: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(module: str, *args: Any) -> Optional[Any]:
        return None if module == name else real(module, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError) as info:
        resolve(compose(["trainer.output_dir=/tmp/easytrain-test-out", f"trainer.loggers=[console,{name}]"]))
    assert str(info.value) == (f"trainer.loggers[1]='{name}': the {name} package is not installed; "
                               f"pip install {name}, or leave {name} out of trainer.loggers")


def test_offline_unless_the_environment_says_otherwise(tmp_path: Path) -> None:
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}) is None  # W&B reads WANDB_MODE itself
    assert mlflow_uri(tmp_path, {}) == f"file:{tmp_path.resolve() / 'mlruns'}"
    assert mlflow_uri(tmp_path, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}) == "http://mlflow:5000"


def test_wandb_offline_run_in_the_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    logger = MetricsLogger(str(tmp_path), ["wandb"], "tiny", "easytrain-tests", {"trainer": {"seed": 1}})
    log_steps(logger, range(1, STEPS + 1))
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((tmp_path / "wandb").iterdir())
    run_id = json.loads((tmp_path / "logger_runs.json").read_text())["wandb"]
    assert runs[0].name.endswith(run_id)


def test_mlflow_file_store_in_the_run_folder_and_a_resume_continues_the_run(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install mlflow)")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    logger = MetricsLogger(str(tmp_path), ["mlflow"], "tiny", "easytrain-tests", {"trainer": {"seed": 1}})
    log_steps(logger, range(1, 4))
    logger.close()
    resumed = MetricsLogger(str(tmp_path), ["mlflow"], "tiny", "easytrain-tests", {"trainer": {"seed": 1}})
    log_steps(resumed, range(4, STEPS + 1))
    resumed.close()

    run_id = json.loads((tmp_path / "logger_runs.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    history = client.get_metric_history(run_id, "reward/mean")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [(s, round(0.1 * s, 6)) for s in range(1, 6)]
    run = client.get_run(run_id)
    assert run.data.params["trainer.seed"] == "1" and run.info.status == "FINISHED"
