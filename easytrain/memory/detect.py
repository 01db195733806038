"""What the watchdog concludes from readings: pressure levels, one rank out of line, steady growth.

Pure functions and small state on plain numbers, so every rule is tested on
constructed series without a cluster.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

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


def imbalance(readings: list[RankMemory], factor: float) -> list[tuple[str, str]]:
    """Ranks whose memory exceeds the median of their role (same figure) by more than ``factor``.

    With two ranks the median is their mean, so a report needs one rank above ``2*factor - 1`` times
    the other (2x at the default 1.5). Returns (key, report) pairs; the key names the rank and figure.
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
                reports.append((f"imbalance {role} {r.rank} {what}", f"{role} rank {r.rank} on node {r.node_ip} holds {r.bytes / MB:.0f} MB {what}, "
                               f"{r.bytes / median:.1f}x the median of its {len(ranks)} ranks "
                               f"({median / MB:.0f} MB); likely causes: {'; '.join(IMBALANCE_CAUSES)}"))
    return reports


def theil_sen_slope(xs: list[float], ys: list[float]) -> float:
    """Median of the pairwise slopes: a line fit that a few outliers do not move."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    return statistics.median(slopes) if slopes else 0.0


@dataclass
class LeakDetector:
    """Steady growth of one series (a node's RAM, a process's RSS, a GPU's reserved bytes) across steps.

    One value per step (its lowest reading in the step). After ``warmup`` steps, over the last ``window``
    steps (at least ``min_points``), a series is reported when its robust (Theil-Sen) slope exceeds
    ``threshold_mb`` MB/step, it grew in at least ``steady`` of the step-to-step changes, and the growth
    the slope explains over the window is at least three times the noise around the fitted line: a
    single jump (a cache filling once) or a level that wanders is not a leak. Each series is reported
    once.
    """

    warmup: int = 5
    threshold_mb: float = 20.0
    window: int = 32
    min_points: int = 24
    """A claim spans 24-32 steps: a node's RAM is shared with Ray's object store and whatever else runs there,
    which here rise and fall by ~0.5 GB over 8-16 steps (the default run's node, step by step); a window of two
    such cycles keeps them from reading as a leak, while a process that really grows keeps growing in it."""
    steady: float = 0.6
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)
    first_step: Optional[int] = None
    """The first step observed: the warm-up counts from it (a resumed run warms up again)."""

    def observe(self, step: int, name: str, value_bytes: float) -> None:
        if self.first_step is None:
            self.first_step = step
        if step - self.first_step < self.warmup:
            return
        points = self.series.setdefault(name, [])
        if points and points[-1][0] == step:
            points[-1] = (step, min(points[-1][1], value_bytes))
        else:
            points.append((step, value_bytes))
        del points[:-self.window]

    def slope_mb(self, name: str) -> Optional[float]:
        """MB per step of the series' last ``window`` steps (None until ``min_points`` are in)."""
        points = self.series.get(name, [])
        if len(points) < self.min_points:
            return None
        return theil_sen_slope([s for s, _ in points], [v / MB for _, v in points])

    def check(self) -> list[tuple[str, str]]:
        """New (key, report) pairs: ``name`` grows ~X MB/step over steps a-b."""
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
            residuals = [v / MB - slope * s for s, v in points]
            centre = statistics.median(residuals)
            noise = 1.4826 * statistics.median(abs(r - centre) for r in residuals)
            if slope * (points[-1][0] - points[0][0]) < 3 * noise:
                continue
            self.reported.add(name)
            grown = (points[-1][1] - points[0][1]) / MB
            reports.append((f"leak {name}", f"{name} grows {slope:.1f} MB/step (+{grown:.0f} MB over steps "
                                            f"{points[0][0]}-{points[-1][0]}): a leak, or a cache without a bound"))
        return reports


def gpu_held(used_bytes: int, workers: list[dict[str, int]]) -> int:
    """What one GPU's memory holds for real: every easytrain process's live peak on it plus what lies outside
    their allocators.

    NVML's "used" counts the caching allocators' free blocks too: on a colocated GPU the engine reserves its KV
    pool up front and every process keeps the blocks of every size it has allocated, so a healthy run reads near
    full. A process whose next phase fits in what it reserved never asks the driver for more, and one that does
    not fit first gives its own free blocks back, so its cache is no pressure. Per worker (dicts with
    ``gpu_allocated_bytes``, ``gpu_reserved_bytes`` and ``gpu_step_peak_bytes``, the allocator's peak since the
    last step boundary) the live figure is the larger of the step's peak and what is allocated now: the demand
    its next step brings back, even where it emptied its cache since. Outside is ``used_bytes`` (NVML, read at
    the same boundary) less all workers' reserved bytes: CUDA contexts, NCCL buffers, an engine core in a
    process of its own (its KV pool with it), other programs."""
    reserved = sum(w["gpu_reserved_bytes"] for w in workers)
    live = sum(max(w.get("gpu_step_peak_bytes", 0), w["gpu_allocated_bytes"]) for w in workers)
    return max(0, used_bytes - reserved) + live


def _uuid(value: object) -> str:
    """A GPU's UUID as NVML ("GPU-5f3c...") and torch ("5f3c...") print it, in one form."""
    text = str(value or "").lower()
    return text[4:] if text.startswith("gpu-") else text


def gpu_pressure(samples: list[dict[str, Any]], workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step's pressure on each GPU, from its NVML samples (``kind: gpu`` records of one step) and the
    workers' allocator readings at the step boundary.

    A GPU whose easytrain processes report their allocators (a worker's ``gpu_uuid`` is the GPU's ``uuid``) is
    judged by what they hold (:func:`gpu_held`, against the GPU's last sample, the one taken at the boundary);
    any other GPU by NVML's highest "used" in the step. Returns one dict per GPU: ``node_ip``, ``index``,
    ``used_bytes`` (NVML's highest), ``held_bytes``, ``total_bytes``, ``fraction`` (judged) and ``basis``
    ("held" or "nvml")."""
    by_gpu: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in samples:
        by_gpu.setdefault((r["node_ip"], r["index"]), []).append(r)
    out = []
    for (node_ip, index), readings in sorted(by_gpu.items()):
        last = max(readings, key=lambda r: r["t"])
        used = max(r["used_bytes"] for r in readings)
        uuid = _uuid(last.get("uuid"))
        on_it = [w for w in workers if uuid and "gpu_reserved_bytes" in w and _uuid(w.get("gpu_uuid")) == uuid]
        held = gpu_held(last["used_bytes"], on_it) if on_it else used
        total = last["total_bytes"]
        out.append({"node_ip": node_ip, "index": index, "used_bytes": used, "held_bytes": held, "total_bytes": total,
                    "fraction": held / total if total else 0.0, "basis": "held" if on_it else "nvml"})
    return out
