"""The node's pressure flag, and the hard threshold that memory's growth rate lowers.

Between two step boundaries the driver cannot see a generation that grows: its phase is one call. So each
node's sampler (:class:`easytrain.memory.watchdog.NodeSampler`) writes the RAM level of every sample to a
small file on its node, and the processes there read it where they can stop early: the HF engine's decode
loop checks it at every token (hard: the generation ends and the step with it; soft: the generation is
redone in smaller pieces). The driver reads the samplers themselves while it waits for the reward workers,
whose user code cannot be stopped from inside (:meth:`easytrain.trainer.base.Trainer.watch_phase`).

The hard threshold is a ceiling. Ray's memory monitor kills at its own line (``RAY_memory_usage_threshold``,
0.95 by default), and between a sample that crosses ``watchdog.ram_hard`` and the growth stopping there is
one more sample period and the reaction: memory that grows fast needs a wider margin. The sampler lowers
the hard threshold so that at the fastest growth it saw lately the stop lands before the kill line
(:func:`hard_threshold`).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Optional

REACTION_S = 1.0
"""Seconds allowed from a sample at the hard level to the growth having stopped (the driver's poll comes round
and kills a reward worker, a decode step ends, the killed process exits). bench/faults.py's 10 in-step
pressure trials measured 0.002-0.18 s from the first hard sample to the driver's stop (``reaction_s``); 1 s
leaves room for the process's exit and a busy driver."""
GROWTH_WINDOW = 3
"""Sample pairs the growth rate is the fastest of: a rise is remembered for a few periods, then memory that
stopped growing is judged by the configured threshold again."""


class MemoryStop(Exception):
    """A process saw the hard flag and stopped its work (the step it belonged to ends unfinished)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def flag_path(job_id: str, node_id: str) -> Path:
    """The flag of one Ray job on one node (every process of a run shares its driver's job id; a local Ray
    numbers its jobs from 1 again, its node id is new each time)."""
    return Path(tempfile.gettempdir()) / f"easytrain-pressure-{job_id}-{node_id[:16]}"


class PressureFlag:
    """One node's level: written whole by the sampler (rename over), read by anyone there, cheaply (a
    ``stat`` per read; the file is read again only when it changed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: Optional[int] = None
        self._value = ("ok", "")

    @classmethod
    def of_this_job(cls) -> Optional["PressureFlag"]:
        """This Ray job's flag on this node; None outside Ray."""
        import ray

        if not ray.is_initialized():
            return None
        context = ray.get_runtime_context()
        return cls(flag_path(context.get_job_id(), context.get_node_id()))

    def write(self, level: str, line: str = "") -> None:
        # a temporary name of this thread's own: two writers (a sampler's loop and a reading the driver asked
        # for) never rename each other's file away
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(f"{level}\n{line}")
        os.replace(tmp, self.path)

    def read(self) -> tuple[str, str]:
        """(level, line): the level of the node's latest sample and, above ok, what it saw."""
        try:
            changed = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return "ok", ""
        if changed != self._seen:
            try:
                level, _, line = self.path.read_text().partition("\n")
            except FileNotFoundError:
                return "ok", ""
            self._seen, self._value = changed, (level or "ok", line)
        return self._value

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def hard_threshold(hard: float, soft: float, ceiling: float, growth_per_s: float, period_s: float) -> float:
    """The hard level to judge a sample by: ``hard`` (watchdog.ram_hard), lowered while memory grows by
    ``growth_per_s`` (a fraction of the limit per second) so that one more sample period and the reaction
    (:data:`REACTION_S`) at that rate still end below ``ceiling`` (where Ray's monitor kills); never below
    ``soft``."""
    lowered = ceiling - max(0.0, growth_per_s) * (period_s + REACTION_S)
    return max(soft, min(hard, lowered))


class GrowthRate:
    """The fastest rise of a RAM fraction between two samples at least ``min_interval_s`` apart, over the last
    few such pairs (a reading the driver asks for between two periodic ones is too close to its neighbour for
    a rate: what moves in a few milliseconds is noise)."""

    def __init__(self, min_interval_s: float, window: int = GROWTH_WINDOW) -> None:
        self.min_interval_s = min_interval_s
        self.rates: deque[float] = deque(maxlen=window)
        self.last: Optional[tuple[float, float]] = None

    def add(self, t: float, fraction: float) -> float:
        if self.last is None:
            self.last = (t, fraction)
        elif t - self.last[0] >= self.min_interval_s:
            self.rates.append((fraction - self.last[1]) / (t - self.last[0]))
            self.last = (t, fraction)
        return max(self.rates, default=0.0)
