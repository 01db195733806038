"""What the watchdog concludes from readings: pressure levels, one rank out of line, steady growth.

Pure functions and small state on plain numbers, so every rule is tested on
constructed series without a cluster.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

MB = 2**20
LEVELS = ("ok", "warn", "soft", "hard")


def level(fraction: float, warn: float, soft: float, hard: float) -> str:
    """The highest threshold ``fraction`` has reached."""
    if fraction >= hard:
        return "hard"
    if fraction >= soft:
        return "soft"
    if fraction >= warn:
        return "warn"
    return "ok"


def worst(levels: list[str]) -> str:
    return max(levels, key=LEVELS.index, default="ok")


@dataclass(frozen=True)
class RankMemory:
    role: str
    rank: int
    node_ip: str
    bytes: int
    what: str = "RSS"
    """Which figure: "RSS" (host) or "GPU reserved"."""


IMBALANCE_CAUSES = ("uneven batches (long sequences or many images landing on one rank)",
                    "one rank holding gathered (unsharded) weights, e.g. rank 0 assembling a full state dict",
                    "a device_map or placement putting more layers or roles on one device")


def imbalance(readings: list[RankMemory], factor: float) -> list[str]:
    """Ranks whose memory exceeds the median of their role (same figure) by more than ``factor``.

    With two ranks the median is their mean, so a report needs one rank above ``2*factor - 1`` times
    the other (2x at the default 1.5).
    """
    reports = []
    groups: dict[tuple[str, str], list[RankMemory]] = {}
    for r in readings:
        groups.setdefault((r.role, r.what), []).append(r)
    for (role, what), ranks in sorted(groups.items()):
        if len(ranks) < 2:
            continue
        median = statistics.median(r.bytes for r in ranks)
        for r in ranks:
            if median > 0 and r.bytes > factor * median:
                reports.append(f"{role} rank {r.rank} on node {r.node_ip} holds {r.bytes / MB:.0f} MB {what}, "
                               f"{r.bytes / median:.1f}x the median of its {len(ranks)} ranks "
                               f"({median / MB:.0f} MB); likely causes: {'; '.join(IMBALANCE_CAUSES)}")
    return reports


def theil_sen_slope(values: list[float]) -> float:
    """Median of the pairwise slopes of ``values`` against their index: robust to a few outliers."""
    slopes = [(values[j] - values[i]) / (j - i) for i in range(len(values)) for j in range(i + 1, len(values))]
    return statistics.median(slopes) if slopes else 0.0


@dataclass
class LeakDetector:
    """Steady growth of one series (a node's RAM, a process's RSS, a GPU's reserved bytes) across steps.

    One value per step (its end-of-step reading). After ``warmup`` steps, over the last ``window`` steps,
    a series is reported when its robust slope exceeds ``threshold_mb`` MB/step *and* it grew in at least
    ``steady`` of the step-to-step changes: a single jump (a cache filling once) or noise around a
    level is not a leak. Each series is reported once.
    """

    warmup: int = 3
    threshold_mb: float = 20.0
    window: int = 12
    min_points: int = 5
    steady: float = 0.7
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)

    def observe(self, step: int, name: str, value_bytes: float) -> None:
        if step <= self.warmup:
            return
        points = self.series.setdefault(name, [])
        if points and points[-1][0] == step:
            points[-1] = (step, value_bytes)  # the latest reading of a step stands for it
        else:
            points.append((step, value_bytes))
        del points[:-self.window]

    def slope_mb(self, name: str) -> Optional[float]:
        points = self.series.get(name, [])
        if len(points) < self.min_points:
            return None
        steps = [s for s, _ in points]
        per_step = [v / MB for _, v in points]
        if steps != list(range(steps[0], steps[0] + len(steps))):  # gaps (a resumed run): scale by step
            slopes = [(per_step[j] - per_step[i]) / (steps[j] - steps[i])
                      for i in range(len(points)) for j in range(i + 1, len(points))]
            return statistics.median(slopes)
        return theil_sen_slope(per_step)

    def check(self) -> list[str]:
        """New reports: ``name`` grows ~X MB/step over steps a-b."""
        reports = []
        for name, points in self.series.items():
            if name in self.reported:
                continue
            slope = self.slope_mb(name)
            if slope is None or slope <= self.threshold_mb:
                continue
            deltas = [b[1] - a[1] for a, b in zip(points, points[1:])]
            if sum(d > 0 for d in deltas) < self.steady * len(deltas):
                continue
            self.reported.add(name)
            grown = (points[-1][1] - points[0][1]) / MB
            reports.append(f"{name} grows {slope:.1f} MB/step (+{grown:.0f} MB over steps "
                           f"{points[0][0]}-{points[-1][0]}): a leak, or a cache without a bound")
        return reports
