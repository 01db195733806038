"""What a plan is checked against and what it holds: capacities, rows per phase, the verdict.

Shared by the RL plan (``planner.py``) and the SFT plan (``sft.py``). The
per-process constants are assumptions both plans use: a worker process costs
``FRAMEWORK_BYTES`` of host RAM before holding a model (measured by
bench/planner_accuracy.py as the empty-worker baseline); a GPU process adds
``CUDA_CONTEXT_BYTES`` of device memory (assumed, typical of CUDA 12).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from easytrain.config.schema import Config

GB = 10**9
FRAMEWORK_BYTES = int(0.48 * GB)
"""Host RAM of an empty worker process (python, torch, transformers, ray imported, nothing built): 0.48 GB
measured here (bench/planner_accuracy.py's baseline); a Ray worker adds its core-worker threads."""
CUDA_CONTEXT_BYTES = int(0.5 * GB)
"""Device memory of one process's CUDA context and allocator slack (assumed)."""
DRIVER_BYTES = int(1.0 * GB)
"""The driver process: framework, data set index, metrics (assumed)."""
RAY_DEFAULT_THRESHOLD = 0.95


@dataclass(frozen=True)
class Capacity:
    gpu_bytes: Optional[int]
    """Memory of one GPU; None on CPU."""
    node_ram: int
    ray_threshold: float
    """Ray's memory monitor kills workers above this fraction of node RAM (RAY_memory_usage_threshold)."""
    source: str

    @property
    def host_limit(self) -> int:
        return int(self.node_ram * self.ray_threshold)


def capacity_of(config: Config) -> Capacity:
    """GPU and node sizes from ``trainer.gpu_memory_gb`` / ``trainer.node_memory_gb``, else this machine."""
    import psutil

    t = config.trainer
    threshold = float(os.environ.get("RAY_memory_usage_threshold", RAY_DEFAULT_THRESHOLD))
    sources = []
    gpu: Optional[int] = None
    if t.device == "cuda":
        if t.gpu_memory_gb:
            gpu, _ = int(t.gpu_memory_gb * GB), sources.append("GPU from trainer.gpu_memory_gb")
        else:
            import torch

            if not torch.cuda.is_available():
                from easytrain.config import ConfigError

                raise ConfigError("trainer.gpu_memory_gb", None, "the plan needs each GPU's memory and this machine "
                                  "has no GPU to read it from", "set it, e.g. trainer.gpu_memory_gb=80 for H100-80GB")
            gpu, _ = torch.cuda.mem_get_info()[1], sources.append("GPU of this machine")
    if t.node_memory_gb:
        ram, _ = int(t.node_memory_gb * GB), sources.append("node RAM from trainer.node_memory_gb")
    else:
        ram, _ = psutil.virtual_memory().total, sources.append("node RAM of this machine")
    return Capacity(gpu, ram, threshold, "; ".join(sources))


@dataclass
class Row:
    """One phase: what each GPU (or, on CPU, each worker process) and each node holds."""

    phase: str
    role: str
    device: int
    """Bytes on the busiest device (CPU: the working process)."""
    host: int
    """Bytes of host RAM per node."""
    parts: dict[str, int] = field(default_factory=dict)
    """Breakdown of ``device`` by what holds it."""
    host_parts: dict[str, int] = field(default_factory=dict)
    process_host: int = 0
    """Host bytes of the phase's busiest worker process (what the plan check compares its RSS peak with)."""


@dataclass
class Plan:
    rows: list[Row]
    """The phases of a step: what the run holds while it trains (the watchdog's view)."""
    capacity: Capacity
    on_gpu: bool
    notes: list[str]
    once: list[Row] = field(default_factory=list)
    """Phases that run once before the first step (the SFT workers' model build): they must fit too, but
    are not part of the running peaks."""

    @property
    def device_peak(self) -> int:
        return max(r.device for r in self.rows)

    @property
    def host_peak(self) -> int:
        return max(r.host for r in self.rows)

    @property
    def device_headroom(self) -> Optional[float]:
        cap = self.capacity.gpu_bytes
        return None if not self.on_gpu or not cap else 1 - self.device_peak / cap

    @property
    def host_headroom(self) -> float:
        return 1 - self.host_peak / self.capacity.host_limit

    def once_headroom(self) -> tuple[Optional[float], float]:
        """(device, host) headroom of the once-only phases (1.0 when there are none)."""
        cap = self.capacity.gpu_bytes
        device = (1 - max((r.device for r in self.once), default=0) / cap) if self.on_gpu and cap else None
        return device, 1 - max((r.host for r in self.once), default=0) / self.capacity.host_limit

    def _margins(self) -> list[float]:
        return [h for h in (self.device_headroom, self.host_headroom, *self.once_headroom()) if h is not None]

    @property
    def fits(self) -> bool:
        return min(self._margins()) >= 0

    @property
    def verdict(self) -> str:
        if not self.fits:
            steps = [h for h in (self.device_headroom, self.host_headroom) if h is not None]
            return "does not fit" if min(steps) < 0 else f"does not fit ({', '.join(r.phase for r in self.once)})"
        return "fits, tight (< 10% headroom)" if min(self._margins()) < 0.10 else "fits"

    def row(self, phase: str) -> Row:
        return next(r for r in self.once + self.rows if r.phase == phase)

    def has(self, phase: str) -> bool:
        return any(r.phase == phase for r in self.once + self.rows)


def sum_parts(parts: dict[str, int]) -> int:
    return sum(parts.values())
