"""Where step metrics go (``trainer.loggers``): one sink per backend.

A sink has ``log(step, metrics)`` and ``close()``, and may have ``rewind(step)``
(a run resuming from the checkpoint of ``step`` forgets what it logged after
it). :class:`~easytrain.trainer.metrics.MetricsLogger` fans every record out
to its sinks; ``MetricsLogger.add`` takes any other object with ``log`` and
``close`` (the Ray dashboard's gauges).

- ``console``: a line per step of the headline metrics (:data:`CONSOLE`).
- ``jsonl``: ``metrics.jsonl`` in the run folder, one JSON object per record.
- ``tensorboard``: event files in ``<run>/tensorboard/<experiment_name>/``.
- ``wandb``: offline into ``<run>/wandb/`` unless ``WANDB_MODE`` says otherwise or
  ``WANDB_API_KEY`` is set (then online); ``wandb sync <run>/wandb/offline-run-*`` uploads later.
  Offline reaches no network (W&B's telemetry included).
- ``mlflow``: a file store at ``<run>/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set
  (``mlflow ui --backend-store-uri <run>/mlruns`` shows it); with the file store MLflow's telemetry is off.

W&B and MLflow are imported only when selected; validation refuses them when
their package is missing. A resumed run continues the same W&B / MLflow run
(ids kept in ``<run>/logger_runs.json``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Protocol

logger = logging.getLogger("easytrain.metrics")

CONSOLE = ("reward/mean", "reward/accuracy", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
           "actor/entropy", "train/loss", "val/loss", "actor/grad_norm", "perf/generate_tokens_per_s",
           "perf/train_tokens_per_s", "time/step")
"""What the console line shows; the other sinks get everything."""

RUN_IDS = "logger_runs.json"
"""W&B and MLflow run ids of the run folder, so a resumed run logs into the same run."""


class Sink(Protocol):
    """What MetricsLogger needs of a backend; ``rewind(step)`` is optional."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _run_id(folder: Path, backend: str) -> Optional[str]:
    path = folder / RUN_IDS
    try:
        value = json.loads(path.read_text()).get(backend)
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return str(value) if value else None


def _save_run_id(folder: Path, backend: str, run_id: str) -> None:
    path = folder / RUN_IDS
    try:
        ids = json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        ids = {}
    ids[backend] = run_id
    path.write_text(json.dumps(ids, indent=1) + "\n")


class ConsoleSink:
    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = {k: v for k, v in metrics.items() if k in CONSOLE or k.startswith("val/reward/mean")}
        if not shown:  # e.g. a checkpoint's record: the driver's log line says it
            return
        logger.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in shown.items()))

    def close(self) -> None:
        pass


class JsonlSink:
    """``metrics.jsonl``: ``{"step": N, key: value, ...}`` per record, flushed as written."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "metrics.jsonl"
        self.file: Optional[Any] = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.file is None:
            self.file = self.path.open("a")
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def rewind(self, step: int) -> None:
        self.close()  # MetricsLogger.rewind truncates the file; the next record reopens it

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class TensorBoardSink:
    """A ``SummaryWriter`` opened at the first record; a rewind purges the events after the step."""

    def __init__(self, folder: Path, run_name: str) -> None:
        self.logdir = folder / "tensorboard" / run_name
        self.writer: Optional[Any] = None
        self.purge_step: Optional[int] = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.logdir), purge_step=self.purge_step)
            self.purge_step = None
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a step takes seconds at least: a live TensorBoard sees every one

    def rewind(self, step: int) -> None:
        self.close()
        self.purge_step = step + 1

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def wandb_mode(env: Optional[dict[str, str]] = None) -> Optional[str]:
    """``offline`` unless the environment chose: None lets W&B read ``WANDB_MODE``; an API key means online."""
    env = dict(os.environ) if env is None else env
    if env.get("WANDB_MODE"):
        return None
    return "online" if env.get("WANDB_API_KEY") else "offline"


class WandbSink:
    """A W&B run in ``<run>/wandb``; every key is plotted against ``step`` (a metric of its own), so a resumed
    run's repeated steps are logged rather than dropped by W&B's monotonic step."""

    def __init__(self, folder: Path, project: str, run_name: str, config: Optional[dict[str, Any]]) -> None:
        import wandb

        mode = wandb_mode()
        if mode is not None:  # the process-wide settings too: their telemetry exporter probes the server unless
            wandb.setup(wandb.Settings(mode=mode))  # offline (wandb 0.31 does so even for an offline run)
        run_id = _run_id(folder, "wandb") or uuid.uuid4().hex[:12]
        self.run: Optional[Any] = wandb.init(project=project, name=run_name, id=run_id, resume="allow",
                                             dir=str(folder), mode=mode, config=config)
        _save_run_id(folder, "wandb", run_id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log({**metrics, "step": step})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


MLFLOW_KEY = re.compile(r"[^\w\-. /]")
"""Characters MLflow refuses in a metric name (it allows letters, digits, ``_-. /``)."""


def mlflow_uri(folder: Path, env: Optional[dict[str, str]] = None) -> str:
    """``MLFLOW_TRACKING_URI`` when set, else a file store in ``<run>/mlruns``."""
    env = dict(os.environ) if env is None else env
    return env.get("MLFLOW_TRACKING_URI") or f"file:{(folder / 'mlruns').resolve()}"


ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"
"""MLflow 3 refuses a file store unless this is true (it keeps the store "in maintenance mode"); easytrain's
offline default sets it, an explicit ``MLFLOW_TRACKING_URI`` (e.g. ``sqlite:///mlflow.db``) does not need it."""
NO_TELEMETRY = "MLFLOW_DISABLE_TELEMETRY"
"""MLflow 3 sends usage telemetry unless this is true; easytrain's offline default (the file store) sets it."""


def _mlflow_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config flattened to dotted keys (MLflow params are flat strings of at most 6000 characters)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_mlflow_params(value, f"{name}."))
        else:
            out[name] = str(value)[:6000]
    return out


class MlflowSink:
    """An MLflow run through ``MlflowClient`` (no global active run); the config goes in as params."""

    def __init__(self, folder: Path, project: str, run_name: str, config: Optional[dict[str, Any]]) -> None:
        uri = mlflow_uri(folder)
        if uri.startswith("file:"):  # offline: no telemetry either (MLflow reads the switch when imported)
            os.environ.setdefault(ALLOW_FILE_STORE, "true")
            os.environ.setdefault(NO_TELEMETRY, "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        run_id = _run_id(folder, "mlflow")
        if run_id is not None:
            try:
                self.client.get_run(run_id)
            except Exception:  # another tracking server, or the store was removed: a new run
                run_id = None
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            if config:
                from mlflow.entities import Param

                params = [Param(k, v) for k, v in _mlflow_params(config).items()]
                for i in range(0, len(params), 100):  # log_batch takes at most 100 params
                    self.client.log_batch(run_id, params=params[i:i + 100])
            _save_run_id(folder, "mlflow", run_id)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id: Optional[str] = run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if self.run_id is None:
            return
        now = int(time.time() * 1000)
        batch = [Metric(MLFLOW_KEY.sub("_", k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None


def make_sink(name: str, folder: Path, project: str, run_name: str, config: Optional[dict[str, Any]]) -> Sink:
    """The sink of one ``trainer.loggers`` entry (names as validation knows them: ``LOGGERS``)."""
    if name == "console":
        return ConsoleSink()
    if name == "jsonl":
        return JsonlSink(folder)
    if name == "tensorboard":
        return TensorBoardSink(folder, run_name)
    if name == "wandb":
        return WandbSink(folder, project, run_name, config)
    if name == "mlflow":
        return MlflowSink(folder, project, run_name, config)
    raise ValueError(f"unknown logger {name!r}")
