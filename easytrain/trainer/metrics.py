"""Metrics: named phase timers, and the logger that sends each step's metrics to the sinks of
``trainer.loggers`` (console, metrics.jsonl, TensorBoard, W&B, MLflow: :mod:`easytrain.trainer.loggers`).

Keys are ``group/name`` (``reward/mean``, ``time/generate``); every record
carries ``step``.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from easytrain.trainer.loggers import CONSOLE, Sink, make_sink

logger = logging.getLogger("easytrain.metrics")

__all__ = ["CONSOLE", "STEP_LOGS", "MetricsLogger", "PhaseTimer", "truncate_jsonl"]


class PhaseTimer:
    """Wall time per named phase of one step (``time/<phase>``)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []
        """(phase, start, end) in wall-clock seconds, for the memory timeline."""

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start, wall = time.perf_counter(), time.time()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + elapsed
            self.spans.append((phase, wall, wall + elapsed))


STEP_LOGS = ("metrics.jsonl", "samples.jsonl", "data_order.jsonl")
"""Run-folder logs keyed by step; a resumed run drops the records written after its checkpoint."""


def truncate_jsonl(path: Path, step: int) -> int:
    """Keep the records of ``path`` with ``step <= step`` (rewritten atomically); returns how many went."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record_step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:  # a line cut short by a crash
            dropped += 1
            continue
        if record_step <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return dropped


class MetricsLogger:
    """Sends each record to the sinks of ``loggers`` and to any added with :meth:`add`; also writes the
    run folder's ``samples.jsonl`` and ``data_order.jsonl``.

    ``config`` (the resolved config as a plain dict) goes to W&B and MLflow as the run's config.
    """

    def __init__(self, output_dir: str, loggers: list[str], run_name: str, project: str = "easytrain",
                 config: Optional[dict[str, Any]] = None) -> None:
        self.loggers, self.run_name = loggers, run_name
        self.folder = Path(output_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.sinks: list[Sink] = [make_sink(name, self.folder, project, run_name, config) for name in loggers]

    def add(self, sink: Sink) -> Sink:
        """Send every later record to ``sink`` too: any object with ``log(step, metrics)`` and ``close()``
        (and, if it can forget, ``rewind(step)``). Returns it."""
        self.sinks.append(sink)
        return sink

    def rewind(self, step: int) -> None:
        """Forget what was logged after ``step`` (a run resuming from the checkpoint of ``step``)."""
        for sink in self.sinks:
            rewind = getattr(sink, "rewind", None)
            if rewind is not None:
                rewind(step)
        dropped = sum(truncate_jsonl(self.folder / name, step) for name in STEP_LOGS)
        if dropped:
            logger.info("resuming at step %d: dropped %d log record(s) written after it", step, dropped)

    def log_order(self, step: int, uids: list[Any]) -> None:
        """The prompts a step consumed, in order (``data_order.jsonl``): the record resumes are checked by."""
        with (self.folder / "data_order.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "uids": uids}) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {k: float(v) for k, v in metrics.items()}
        for sink in self.sinks:
            sink.log(step, record)

    def write_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        with (self.folder / "samples.jsonl").open("a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}) + "\n")

    def close(self) -> None:
        """Close every sink; one that fails is logged and the others are still closed."""
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001 - the others still need closing, the run is done
                logger.warning("closing metrics sink %s failed: %s", type(sink).__name__, err)
