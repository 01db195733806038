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
           "actor/entropy", "actor/grad_norm", "perf/tokens_per_s", "time/step")
"""What the console line shows; metrics.jsonl and TensorBoard get everything."""


class PhaseTimer:
    """Wall time per named phase of one step (``time/<phase>``)."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + time.perf_counter() - start


class MetricsLogger:
    def __init__(self, output_dir: str, loggers: list[str], run_name: str) -> None:
        self.console = "console" in loggers
        self.folder = Path(output_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.jsonl = (self.folder / "metrics.jsonl").open("a") if "jsonl" in loggers else None
        self.tensorboard: Optional[Any] = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.folder / "tensorboard" / run_name))

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
        if self.tensorboard is not None:
            self.tensorboard.close()
