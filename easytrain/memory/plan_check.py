"""The plan against the run: every worker call's measured peak next to the phase's planned bytes.

The workers measure each dispatched call's host and device peak (:mod:`easytrain.memory.peaks`); the driver
drains them at the step boundary, after the models load, after a resume, a checkpoint and a validation
(:meth:`PlanCheck.record`). Each worker method belongs to a phase of the plan (:data:`METHOD_PHASE`; a
generation in a validation is the ``validation`` phase). Every reading goes into ``memory.jsonl`` as a
``phase_peak`` record with the planned figures beside it, and where a process's peak exceeds its phase's plan
by more than :data:`MISS_FRACTION` (host: the worker process's RSS; GPU: torch's allocator peak against the
device plan less the CUDA context), a ``plan_miss`` event and a warning in the run log give both numbers, so a
planner error can be reported with its data.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

from easytrain.config.schema import Config
from easytrain.memory.data_shape import DataCosts
from easytrain.memory.capacity import CUDA_CONTEXT_BYTES, Plan

logger = logging.getLogger(__name__)

MISS_FRACTION = 0.10
"""A phase's measured peak above its plan by more than this is a plan miss."""
METHOD_PHASE = {
    "setup": "load", "load_checkpoint": "resume_load", "save_checkpoint": "checkpoint_save",
    "generate": "generation", "compute_ref_log_probs": "ref_log_probs", "compute_log_probs": "old_log_probs",
    "update": "update", "sync_weights": "weight_sync", "finish_weight_update": "weight_sync",
    "push_weights": "weight_sync",
    # SFT's phases (easytrain.memory.sft)
    "sft_update": "sft_update", "sft_eval": "validation",
}
"""The plan phase each worker method computes in; methods not named here (readings, set-up calls) are skipped."""


@dataclass(frozen=True)
class Planned:
    process_host: int
    """Host bytes of the phase's busiest worker process."""
    device: int
    """Device bytes (GPU) of the phase's busiest device; unused on CPU, where the process's RSS says it."""


def planned_phases(plan: Plan) -> dict[str, Planned]:
    """Planned figures per phase; an SFT plan's ``setup`` is the ``load``, its ``validate`` the ``validation``,
    and its one worker call per step
    (``sft_update``) spans its forward-backward and optimizer phases, so it gets the larger of the two."""
    out = {r.phase: Planned(r.process_host, r.device) for r in plan.once + plan.rows}
    if "setup" in out:
        out.setdefault("load", out["setup"])
    if "validate" in out:
        out.setdefault("validation", out["validate"])
    sft = [out[p] for p in ("forward_backward", "optimizer") if p in out]
    if sft:
        out["sft_update"] = Planned(max(p.process_host for p in sft), max(p.device for p in sft))
    return out


def phase_of(method: str, context: str) -> Optional[str]:
    phase = METHOD_PHASE.get(method)
    return "validation" if phase == "generation" and context == "validation" else phase


class PlanCheck:
    """Compares the workers' measured phase peaks with the plan and writes both to ``memory.jsonl``."""

    def __init__(self, plan: Plan, write: Optional[Callable[[dict[str, Any]], None]] = None) -> None:
        self.planned = planned_phases(plan)
        self.data = plan.data
        """The rows' costs the plan was priced on (its re-plans take them too)."""
        self.on_gpu = plan.on_gpu
        self.write = write
        self.misses: list[dict[str, Any]] = []
        self.sizes: dict[str, int] = {}
        """The run-time sizes (:meth:`easytrain.trainer.micro_batches.Forward.overrides`) the plan prices; empty:
        the config's."""

    def follow(self, config: Config, sizes: dict[str, int]) -> bool:
        """Plan again at the run's present micro batch sizes where they changed (the watchdog halved one);
        True when it did."""
        from easytrain.config import with_overrides
        from easytrain.memory.planner import plan

        now = self.sizes or {key: operator.attrgetter(key)(config) for key in sizes}
        if sizes == now:
            return False
        self.planned, self.sizes = planned_phases(plan(with_overrides(config, sizes), data=self.data)), dict(sizes)
        return True

    @classmethod
    def of(cls, config: Config, write: Optional[Callable[[dict[str, Any]], None]] = None,
           data: Optional[DataCosts] = None) -> Optional["PlanCheck"]:
        """The check of ``config``'s plan (priced on the rows the run read, ``data``, where given); None (said in
        the log) when the model's shape is unknown offline."""
        from easytrain.memory.planner import plan

        try:
            return cls(plan(config, data=data), write)
        except Exception as error:  # noqa: BLE001 - without a plan the run goes on unchecked
            logger.warning("no plan to check the run against (%s: %s)", type(error).__name__, error)
            return None

    def record(self, step: int, context: str, readings: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The processes' ``phase_peaks`` readings (:meth:`WorkerBase.phase_peaks`) drained at ``context``
        (``step``, ``start``, ``save``, ``validation``); returns the plan misses among them."""
        misses = []
        for reading in readings:
            for method, peak in reading["peaks"].items():
                phase = phase_of(method, context)
                if phase is None:
                    continue
                planned = self.planned.get(phase)
                record = {"kind": "phase_peak", "step": step, "context": context, "phase": phase, "method": method,
                          "role": reading["role"], "rank": reading["rank"], "node_ip": reading["node_ip"],
                          "pid": reading["pid"], **peak}
                if planned is not None:
                    record["planned_process_host_bytes"] = planned.process_host
                    if self.on_gpu:
                        record["planned_device_bytes"] = planned.device - CUDA_CONTEXT_BYTES
                if self.write is not None:
                    self.write(record)
                misses += self._misses(record)
        for miss in misses:
            logger.warning("plan miss: %s %s rank %d in %s: %.2f GB measured, %.2f GB planned (+%.0f%%)",
                           miss["role"], miss["what"], miss["rank"], miss["phase"], miss["measured_bytes"] / 1e9,
                           miss["planned_bytes"] / 1e9, 100 * (miss["measured_bytes"] / miss["planned_bytes"] - 1))
            if self.write is not None:
                self.write({"kind": "event", "level": "plan_miss", "step": step, "t": miss["end"],
                            "message": f"{miss['phase']}: {miss['what']} above plan", **miss})
        self.misses += misses
        return misses

    def _misses(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        pairs = [("host", record["host_bytes"], record.get("planned_process_host_bytes", 0))]
        if self.on_gpu:
            pairs.append(("device", record["device_bytes"], record.get("planned_device_bytes", 0)))
        for what, measured, planned in pairs:
            if planned > 0 and measured > planned * (1 + MISS_FRACTION):
                out.append({"phase": record["phase"], "what": what, "role": record["role"], "rank": record["rank"],
                            "node_ip": record["node_ip"], "measured_bytes": measured, "planned_bytes": planned,
                            "end": record["end"]})
        return out
