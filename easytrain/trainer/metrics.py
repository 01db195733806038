"""Metrics: named phase timers, and loggers (console, metrics.jsonl, TensorBoard).

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

logger = logging.getLogger("easytrain.metrics")

CONSOLE = ("reward/mean", "reward/accuracy", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
           "actor/entropy", "train/loss", "val/loss", "actor/grad_norm", "perf/tokens_per_s", "time/step")
"""What the console line shows; metrics.jsonl and TensorBoard get everything."""


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
    def __init__(self, output_dir: str, loggers: list[str], run_name: str) -> None:
        self.console = "console" in loggers
        self.loggers, self.run_name = loggers, run_name
        self.folder = Path(output_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.jsonl: Optional[Any] = None
        self.tensorboard: Optional[Any] = None
        self._open()

    def _open(self, purge_step: Optional[int] = None) -> None:
        self.jsonl = (self.folder / "metrics.jsonl").open("a") if "jsonl" in self.loggers else None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.folder / "tensorboard" / self.run_name), purge_step=purge_step)

    def rewind(self, step: int) -> None:
        """Forget what was logged after ``step`` (a run resuming from the checkpoint of ``step``)."""
        self.close()
        dropped = sum(truncate_jsonl(self.folder / name, step) for name in STEP_LOGS)
        if dropped:
            logger.info("resuming at step %d: dropped %d log record(s) written after it", step, dropped)
        self._open(purge_step=step + 1)

    def log_order(self, step: int, uids: list[Any]) -> None:
        """The prompts a step consumed, in order (``data_order.jsonl``): the record resumes are checked by."""
        with (self.folder / "data_order.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "uids": uids}) + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.console:
            shown = {k: v for k, v in metrics.items() if k in CONSOLE or k.startswith("val/reward/mean")}
            logger.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in shown.items()))

    def write_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        with (self.folder / "samples.jsonl").open("a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}) + "\n")

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
