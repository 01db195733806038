"""Metrics loggers (trainer.loggers): TensorBoard event files hold every step's metrics (and a resume purges
what came after its checkpoint), metrics.jsonl as before, added sinks, W&B and MLflow offline (the dev extra
installs both; their runs are read back from the run folder, and no network is tried), and validation naming a
selected logger whose package is missing."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from easytrain.config import ConfigError, compose
from easytrain.config.validate import LOGGERS
from easytrain.main import resolve
from easytrain.trainer.loggers import ALLOW_FILE_STORE, NO_TELEMETRY, make_sink, mlflow_uri, wandb_mode
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


def is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def remote_host(event: str, args: tuple[Any, ...]) -> Optional[str]:
    """The host a name lookup or an IP connection goes to, when it is not this machine."""
    if event == "socket.getaddrinfo":
        host = args[0]
    elif event == "socket.connect" and isinstance(args[1], tuple):  # AF_UNIX connects to a path
        host = args[1][0]
    else:
        return None
    host = host.decode() if isinstance(host, bytes) else host
    return None if host is None or is_local(str(host)) else str(host)


class NetworkWatch:
    """Writes every name lookup and connection this process makes to a host that is not this machine to
    ``record`` as it happens, threads and exit handlers included: a Python audit hook, which sees the real calls
    and changes none (helper processes, W&B's wandb-core, are outside it)."""

    def __init__(self, record: Path) -> None:
        self.fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        sys.addaudithook(self)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        host = remote_host(event, args)
        if host is not None:
            os.write(self.fd, f"{event} {host}\n".encode())  # os.write raises no audit event of its own


def log_in_this_process(run_dir: str, loggers: str, first: str, last: str, reached: str) -> None:
    """The child process of :func:`log_in_a_fresh_process` (its command-line arguments)."""
    NetworkWatch(Path(reached))
    logger = MetricsLogger(run_dir, loggers.split(","), "tiny", "easytrain-tests", {"trainer": {"seed": 1}})
    log_steps(logger, range(int(first), int(last) + 1))
    logger.close()


CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); import test_loggers; "
         "test_loggers.log_in_this_process(*sys.argv[2:])")
NOT_INHERITED = ("WANDB_", "MLFLOW_", "PYTEST_", "CI", "GITHUB_ACTIONS", "DO_NOT_TRACK")
"""Left out of the child's environment: no server, key or mode chosen, and nothing that tells MLflow it runs
under a test or CI (it turns its telemetry off by itself there: the logger must)."""


def log_in_a_fresh_process(run_dir: Path, loggers: list[str], steps: range, tmp_path: Path,
                           env: Optional[dict[str, str]] = None) -> list[str]:
    """Log ``steps`` to ``loggers`` in a new Python process, as a run's driver does, until it exits (W&B's
    wandb-core finishes writing the run's file then); the hosts it tried to reach. W&B's settings and caches go
    to ``tmp_path``."""
    reached = tmp_path / f"reached-{steps.start}"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(NOT_INHERITED)}
    child_env.update({"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **(env or {})})
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        child_env[var] = str(tmp_path / var.lower())
    proc = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), str(run_dir), ",".join(loggers),
                           str(steps.start), str(steps.stop - 1), str(reached)],
                          env=child_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return reached.read_text().splitlines() if reached.exists() else []


def wandb_records(path: Path) -> list[Any]:
    """The ``Record`` protobufs of a ``.wandb`` file, W&B's transaction log (no reader ships with wandb 0.31):
    a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of chunks, each a 7-byte header (CRC-32,
    little-endian 16-bit length, type 1 full / 2 first / 3 middle / 4 last) and its bytes; a block's last
    bytes are padding when fewer than 7 remain."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", data[:7]
    records, pending, pos = [], b"", header
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if kind == 0:  # zero padding at the end of the file
            break
        pending += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records: list[Any]) -> list[dict[str, Any]]:
    """The logged rows (W&B's own ``_step``, ``_runtime``, ``_timestamp`` left out)."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def wandb_config(records: list[Any]) -> dict[str, Any]:
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs
    return {item.key: json.loads(item.value_json) for item in runs[0].config.update if item.key != "_wandb"}


def test_wandb_offline_run_in_the_run_folder_holds_every_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert log_in_a_fresh_process(run_dir, ["wandb"], range(1, STEPS + 1), tmp_path) == []
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    run_id = json.loads((run_dir / "logger_runs.json").read_text())["wandb"]
    assert runs[0].name.endswith(run_id)
    records = wandb_records(runs[0] / f"run-{run_id}.wandb")
    history = wandb_history(records)
    assert [row["step"] for row in history] == list(range(1, STEPS + 1))
    for row in history:
        assert row == pytest.approx({"step": row["step"], **metrics_of(row["step"])})
    assert wandb_config(records) == {"trainer": {"seed": 1}}


@pytest.mark.parametrize("where", ["run folder", "MLFLOW_TRACKING_URI"])
def test_mlflow_local_store_holds_every_step_and_a_resume_continues_the_run(where: str, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 1-3, then a resumed process logs 4-5 into the same run."""
    monkeypatch.setenv(ALLOW_FILE_STORE, "true")  # for this process's own client, which reads the store back
    monkeypatch.setenv(NO_TELEMETRY, "true")
    from mlflow.tracking import MlflowClient

    run_dir, store, env = tmp_path / "run", tmp_path / "run" / "mlruns", {}
    if where == "MLFLOW_TRACKING_URI":
        store = tmp_path / "tracking"
        env = {"MLFLOW_TRACKING_URI": f"file:{store}"}
    for steps in (range(1, 4), range(4, STEPS + 1)):
        assert log_in_a_fresh_process(run_dir, ["mlflow"], steps, tmp_path, env) == []

    run_id = json.loads((run_dir / "logger_runs.json").read_text())["mlflow"]
    assert store.is_dir()
    client = MlflowClient(tracking_uri=f"file:{store}")
    for key in metrics_of(0):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(s, pytest.approx(metrics_of(s)[key])) for s in range(1, STEPS + 1)], key
    run = client.get_run(run_id)
    assert run.data.params["trainer.seed"] == "1" and run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the resume logged into the same run
