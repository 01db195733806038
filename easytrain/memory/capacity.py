"""What a plan is checked against and what it holds: capacities, rows per phase, the verdict.

Shared by the RL plan (``planner.py``) and the SFT plan (``sft.py``). A GPU
process adds ``CUDA_CONTEXT_BYTES`` of device memory (assumed, typical of CUDA
12); the host RAM of processes is priced in :mod:`easytrain.memory.host`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from easytrain.config.derived import ray_kill_threshold
from easytrain.config.schema import Config

GB = 10**9
CUDA_CONTEXT_BYTES = int(0.5 * GB)
"""Device memory of one process's CUDA context and allocator slack (assumed)."""
CUDA_WORKSPACE_BYTES = 64 * 2**20
"""cuBLAS and cuBLASLt workspaces (32 MiB each on Hopper), taken through torch's caching allocator at a process's
first matrix product and kept: 65 to 68 MB of every phase after the load of the tiny model on an H200, where its
tensors are ~1 MB (bench/results/gpu_smoke.json, run tiny_bf16: a calibration row). Older GPUs take less; the
plan keeps Hopper's figure."""


def gpu_process_device(phase: str) -> dict[str, int]:
    """What one GPU process holds on its device besides tensors in ``phase``: the CUDA context, and after the
    load the math libraries' workspaces (allocated at the first kernel that needs them)."""
    parts = {"cuda context": CUDA_CONTEXT_BYTES}
    if phase not in ("load", "setup"):
        parts["cuda library workspaces"] = CUDA_WORKSPACE_BYTES
    return parts


@dataclass(frozen=True)
class Capacity:
    gpu_bytes: Optional[int]
    """Memory of one GPU; None on CPU."""
    node_ram: int
    ray_threshold: float
    """Ray's memory monitor kills workers above this fraction of node RAM (RAY_memory_usage_threshold)."""
    source: str
    host_margin: float = 0.0
    """The planner's worst recorded under-prediction of host bytes (:func:`accuracy_margin`): a plan fits when
    its host peaks times (1 + this) fit."""
    device_margin: float = 0.0
    """The same for device bytes (GPU rows of the accuracy results; 0 where none were measured)."""
    margin_source: str = ""

    @property
    def host_limit(self) -> int:
        return int(self.node_ram * self.ray_threshold)


ACCURACY_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "planner_accuracy.json"
"""bench/planner_accuracy.py's whole runs on CPU: the plan's host bytes per phase against the node's."""
GPU_RESULTS = (ACCURACY_RESULTS.with_name("gpu_smoke.json"), ACCURACY_RESULTS.with_name("gpu_check.json"))
"""Whole runs on a GPU, the plan's device bytes per phase against torch's peaks: bench/gpu_smoke.py's (the
calibration runs) and bench/gpu_check.py's (held out: quoted, not used for the margin)."""
MARGIN_SPLIT = "calibration"
"""The margins are fitted like every other constant: on calibration runs only. Held-out runs are quoted, never
used to change a constant, so their misses do not move the margin (bench/planner_accuracy.py)."""


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def worst_under(accuracy: dict, measure: Optional[str] = None) -> Optional[float]:
    """The calibration split's ``worst_under_prediction`` of a result's accuracy (``{split: {...}}``, or under
    ``split[measure]``); None when it has none."""
    figure = accuracy.get(MARGIN_SPLIT, {})
    figure = figure.get(measure, {}) if measure else figure
    value = figure.get("worst_under_prediction")
    return None if value is None else float(value)


def _gpu_accuracy(record: dict) -> dict:
    """A GPU result's accuracy splits: top-level (gpu_smoke) or its memory part's (gpu_check)."""
    return record.get("accuracy") or record.get("parts", {}).get("memory", {}).get("accuracy", {})


def accuracy_margin(path: Path = ACCURACY_RESULTS,
                    gpu_paths: tuple[Path, ...] = GPU_RESULTS) -> tuple[float, float, str]:
    """(host, device) margins and where they come from: the worst under-prediction (predicted below measured)
    recorded over all phases of the calibration runs, as a fraction of the measurement: host from
    bench/planner_accuracy.py's runs, device (torch's allocator peaks) from the GPU results' calibration runs; 0
    for a kind never under-predicted or never measured."""
    result = _read(path)
    if not result:
        return 0.0, 0.0, f"no accuracy results ({path.name} not found): no margin"
    host = max(0.0, -(worst_under(result.get("accuracy", {})) or 0.0))
    device, where = 0.0, []
    for gpu_path in gpu_paths:
        gpu = _read(gpu_path)
        worst = worst_under(_gpu_accuracy(gpu), "device_torch")
        if worst is None:
            continue
        device = max(device, -worst)
        name = gpu.get("device", {}).get("name") or gpu.get("parts", {}).get("machine", {}).get("device", {}).get(
            "name", "?")
        where.append(f"bench/results/{gpu_path.name} ({name}, {gpu.get('date', '?')})")
    source = "; device: " + ", ".join(where) if where else "; device: none measured on a GPU"
    return host, device, (f"margin {host:.1%} host{f', {device:.1%} device' if device else ''}: the worst "
                          f"under-prediction of the calibration runs in bench/results/{path.name} "
                          f"({result.get('date', '?')}){source}")


def capacity_of(config: Config) -> Capacity:
    """GPU and node sizes from ``trainer.gpu_memory_gb`` / ``trainer.node_memory_gb``, else this machine."""
    import psutil

    t = config.trainer
    threshold = ray_kill_threshold()
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
    host_margin, device_margin, margin_source = accuracy_margin()
    return Capacity(gpu, ram, threshold, "; ".join(sources), host_margin, device_margin, margin_source)


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
    """Phases outside the step: the model load before the first step, a checkpoint save, a resume, the HF
    export (:mod:`easytrain.memory.host`). They must fit too, but are not the step's running peaks (which
    the watchdog compares with)."""
    data: Any = None
    """The rows' costs it was priced on (:class:`easytrain.memory.data_shape.DataCosts`; its re-plans take them
    too); None: every row at the data limits."""

    @property
    def device_peak(self) -> int:
        return max(r.device for r in self.rows)

    @property
    def host_peak(self) -> int:
        return max(r.host for r in self.rows)

    @property
    def host_room(self) -> int:
        """Bytes of the node left under Ray's threshold beside the step's host peak with the margin (0 when none):
        what ``trainer.rollout_mode=async``'s queue takes with ``trainer.async_queue_gb=-1``."""
        c = self.capacity
        return max(0, int(c.host_limit - self.host_peak * (1 + c.host_margin)))

    def queue_note(self, queue_gb: float) -> str:
        """The async queue's line: its bound per node, set (``queue_gb``) or the room the run takes as it."""
        if queue_gb > 0:
            return (f"async queue: up to {queue_gb:.2f} GB on the driver's node (trainer.async_queue_gb), counted in "
                    "every phase's host figure")
        return (f"async queue: up to {self.host_room / 1e9:.2f} GB on the driver's node, the room under Ray's "
                f"threshold beside the step's peak with the {self.capacity.host_margin:.0%} margin "
                "(trainer.async_queue_gb=-1)")

    @property
    def device_headroom(self) -> Optional[float]:
        """What is left of a GPU at the step's device peak plus the margin (:attr:`Capacity.device_margin`)."""
        cap = self.capacity.gpu_bytes
        return None if not self.on_gpu or not cap else 1 - self.device_peak * (1 + self.capacity.device_margin) / cap

    @property
    def host_headroom(self) -> float:
        """What is left of the node's RAM under Ray's threshold at the step's host peak plus the margin."""
        return 1 - self.host_peak * (1 + self.capacity.host_margin) / self.capacity.host_limit

    def once_headroom(self) -> tuple[Optional[float], float]:
        """(device, host) headroom of the phases outside the step (1.0 when there are none), margins included."""
        c = self.capacity
        device = (1 - max((r.device for r in self.once), default=0) * (1 + c.device_margin) / c.gpu_bytes
                  if self.on_gpu and c.gpu_bytes else None)
        return device, 1 - max((r.host for r in self.once), default=0) * (1 + c.host_margin) / c.host_limit

    def _margins(self) -> list[float]:
        return [h for h in (self.device_headroom, self.host_headroom, *self.once_headroom()) if h is not None]

    @property
    def fits(self) -> bool:
        return min(self._margins()) >= 0

    @property
    def verdict(self) -> str:
        if not self.fits:
            steps = [h for h in (self.device_headroom, self.host_headroom) if h is not None]
            c = self.capacity
            cap = c.gpu_bytes if self.on_gpu else None
            over = [r.phase for r in self.once if r.host * (1 + c.host_margin) > c.host_limit
                    or (cap and r.device * (1 + c.device_margin) > cap)]
            return "does not fit" if min(steps) < 0 else f"does not fit ({', '.join(over)})"
        return "fits, tight (< 10% headroom)" if min(self._margins()) < 0.10 else "fits"

    def row(self, phase: str) -> Row:
        return next(r for r in self.once + self.rows if r.phase == phase)

    def has(self, phase: str) -> bool:
        return any(r.phase == phase for r in self.once + self.rows)


def sum_parts(parts: dict[str, int]) -> int:
    return sum(parts.values())
