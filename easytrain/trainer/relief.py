"""The trainer's side of the memory watchdog: judge each step, relieve pressure, stop before a kill.

At every step boundary the guard drains the node samplers (``memory/watchdog.py``)
and acts on the highest level reached during the step:

- ``warn``: a log line and an event in ``memory.jsonl``;
- ``soft``: the relief actions of ``watchdog.actions``, in order, each logged
  with the bytes it freed, measured where it ran (an action that cannot free
  anything here is skipped with the reason, never claimed);
- ``hard``: the trainer saves a checkpoint at once and stops with a message
  naming where the pressure is, which processes grew, and the planner's
  changes that lower the peak.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from easytrain.config.schema import Config
from easytrain.memory.detect import MB
from easytrain.memory.readings import process_info, release_process_memory
from easytrain.memory.watchdog import Watchdog
from easytrain.trainer.micro_batches import Forward
from easytrain.trainer.roles import Roles

logger = logging.getLogger(__name__)


@dataclass
class Relief:
    """What one relief action did: bytes freed (measured; 0 when nothing was), why or how, per-process
    figures; an action whose effect shows only later (a smaller micro batch) is ``applied`` with the
    planner's figure in ``planned``, never counted as freed."""

    freed: int
    detail: str
    processes: list[dict[str, Any]] = field(default_factory=list)
    applied: bool = False
    planned: int = 0

    def __post_init__(self) -> None:
        self.applied = self.applied or self.freed > 0


class MemoryGuard:
    def __init__(self, config: Config, output_dir: str) -> None:
        self.config = config
        self.watchdog = Watchdog(config, output_dir)
        self.roles: Optional[Roles] = None
        self.forward: Optional[Forward] = None
        """The run's micro batch layout, whose sizes the relief may halve."""
        self.relieved_step = -1
        """The step whose phases last ran relief (at most once inside a step)."""
        self.queue: Optional[Any] = None
        """trainer.rollout_mode=async: the queue of finished samples (:class:`~easytrain.trainer.asynchronous.
        SampleQueue`), whose bound the soft level lowers before any other action."""

    def register(self, roles: Roles, forward: Forward) -> None:
        """Every easytrain process of the run (workers of each role, reward workers, the driver), and the run's
        micro batch layout."""
        self.roles, self.forward = roles, forward
        processes = [process_info("driver", 0)] + (roles.rewards.process_info() if roles.rewards else [])
        for group in roles.groups():
            processes += group.call("process_info")
        self.watchdog.register(processes)

    def after_step(self, step: int, spans: list[tuple[str, float, float]],
                   readings: list[dict[str, Any]]) -> tuple[dict[str, float], Optional[str]]:
        """Judge the step that just ended (its phases, the workers' own readings); returns metrics and, at the
        hard level, why the run must stop."""
        start = time.perf_counter()
        self.watchdog.phases(step, spans)
        verdict = self.watchdog.collect(step, readings)
        for line in verdict.findings:
            logger.warning("memory: %s", line)
        metrics = dict(verdict.metrics)
        stop = None
        if verdict.level == "warn":
            logger.warning("memory: %s", "; ".join(verdict.pressure))
        elif verdict.level == "soft":
            logger.warning("memory: %s; relief: %s", "; ".join(verdict.pressure), ", ".join(self.config.watchdog.actions))
            metrics["memory/relief_freed_gb"] = sum(self.relieve(step, verdict.resources)) / 2**30
            self.watchdog.skip_pending()  # samples taken while relief freed memory are not judged
        elif verdict.level == "hard":
            stop = self.explain(verdict.pressure, verdict.metrics)
            self.watchdog.event(step, "stop", stop)
        metrics["time/watchdog"] = time.perf_counter() - start
        return metrics, stop

    def between_phases(self, step: int, phase: str) -> Optional[str]:
        """Check the nodes' RAM after ``phase`` of a running step: soft pressure is relieved now (once per step),
        warn is logged; at the hard level returns why the run must stop (memory that grows inside a step must
        not wait for the step boundary, where Ray's memory monitor may already have killed a worker)."""
        lv, pressure = self.watchdog.between_phases()
        if lv == "ok":
            return None
        if lv == "hard":
            return self._stop(step, phase, pressure, "after")
        where = f"after {phase} of step {step}"
        self.watchdog.event(step, lv, f"{'; '.join(pressure)} ({where})", phase=phase)
        if lv == "soft" and self.relieved_step != step:
            self.relieved_step = step
            logger.warning("memory %s: %s; relief: %s", where, "; ".join(pressure), ", ".join(self.config.watchdog.actions))
            self.relieve(step, {"ram"})
            self.watchdog.skip_pending()  # the step boundary judges what follows the relief, not what it freed
        elif lv == "warn":
            logger.warning("memory %s: %s", where, "; ".join(pressure))
        return None

    def during_phase(self, step: int, phase: str) -> Optional[str]:
        """Node RAM while ``phase`` still runs: at the hard level, why the run must stop (recorded); lower levels
        wait for the phase's end, where relief can run (the workers are busy now)."""
        lv, pressure = self.watchdog.between_phases(reset=False)
        return self._stop(step, phase, pressure, "during") if lv == "hard" else None

    def stopped_during(self, step: int, phase: str, seen: str) -> str:
        """A worker stopped ``phase`` on the hard flag it read (``seen``): recorded, explained."""
        lv, pressure = self.watchdog.between_phases(reset=False)  # the processes' sizes now, for what grew
        return self._stop(step, phase, pressure if lv == "hard" else [seen], "during")

    def _stop(self, step: int, phase: str, pressure: list[str], when: str) -> str:
        self.watchdog.event(step, "hard", f"{'; '.join(pressure)} ({when} {phase} of step {step})", phase=phase)
        stop = self.explain(pressure, {})
        self.watchdog.event(step, "stop", stop)
        return stop

    # ------------------------------------------------------------------ relief

    def relieve(self, step: int, resources: set[str]) -> list[int]:
        """Run each configured action for the memory under pressure ("ram", "vram"); returns the bytes each
        freed, measured (0 when it was skipped or its effect comes later)."""
        freed = []
        if self.queue is not None and "ram" in resources:  # what the queue would grow into, before anything else
            before = self.queue.bound
            self.queue.shrink()
            self.watchdog.event(step, "relief", f"async queue bound {before / 2**30:.3f} -> "
                                f"{self.queue.bound / 2**30:.3f} GiB", action="shrink_async_queue", freed_bytes=0,
                                planned_bytes=before - self.queue.bound, skipped=False, processes=[],
                                started=time.time())
        for action in self.config.watchdog.actions:
            started = time.time()
            relief: Relief = getattr(self, action)(resources)
            freed.append(relief.freed)
            if relief.freed:
                logger.warning("memory relief %s: freed %.0f MB (%s)", action, relief.freed / MB, relief.detail)
            elif relief.applied:
                logger.warning("memory relief %s: %s (planned %.0f MB lower)", action, relief.detail,
                               relief.planned / MB)
            else:
                logger.info("memory relief %s: skipped, %s", action, relief.detail)
            self.watchdog.event(step, "relief", f"{action}: {relief.detail}", action=action, freed_bytes=relief.freed,
                                planned_bytes=relief.planned, skipped=not relief.applied,
                                processes=relief.processes, started=started)
        return freed

    def free_caches(self, resources: set[str]) -> Relief:
        """Garbage, the CUDA caching allocator and glibc's free heap in every process: RSS before and after."""
        assert self.roles is not None
        results = [{"role": "driver", "rank": 0, **release_process_memory()}]
        if self.roles.rewards is not None:
            results += self.roles.rewards.release_memory()
        for group in self.roles.groups():
            results += group.call("release_memory")
        total = sum(r["ram_freed_bytes"] + r["gpu_freed_bytes"] for r in results)
        detail = ", ".join(f"{r['role']} {r['rank']}: {(r['ram_freed_bytes'] + r['gpu_freed_bytes']) / MB:.0f} MB"
                           for r in results if r["ram_freed_bytes"] + r["gpu_freed_bytes"] >= MB)
        return Relief(total, detail or "nothing held in caches (every process under 1 MB freed)", results)

    def sleep_rollout(self, resources: set[str]) -> Relief:
        """Between steps the engine holds its weights (woken for the sync). Asleep, it frees them from its device
        until the next rollout: level 2 drops them (the driver refills them from the actor before the next
        generation: one in-process sync, :meth:`Roles.wake_engine`), level 1 moves them to host memory (GPU)."""
        assert self.roles is not None
        level, on_gpu = self.config.worker.rollout.sleep_level, self.config.trainer.device == "cuda"
        if not self.roles.rollout_sleeps:
            return Relief(0, "the rollout engine cannot sleep here (engines sleep in fused workers, "
                             "trainer.colocate=true, with worker.rollout.sleep_level > 0: vLLM on a GPU, the HF "
                             "engine on a GPU or at level 2)")
        if "vram" not in resources and (on_gpu and level == 1):
            return Relief(0, "host RAM is under pressure: level-1 sleep moves the engine's weights into host RAM")
        if ("vram" if on_gpu else "ram") not in resources:
            return Relief(0, f"{'host RAM' if on_gpu else 'GPU memory'} is under pressure: the engine's sleep frees "
                             f"{'GPU memory' if on_gpu else 'host RAM'}")
        freed = self.roles.sleep_engine()
        return Relief(freed, f"engine asleep (level {level}) until the next rollout"
                             + (", which refills its weights from the actor" if level == 2 else ""))

    def offload_ref(self, resources: set[str]) -> Relief:
        assert self.roles is not None
        if "vram" not in resources:
            return Relief(0, "host RAM is under pressure: offloading moves the reference into host RAM")
        if self.roles.ref is None:
            return Relief(0, "no reference worker group in this run")
        if self.config.trainer.device == "cpu":
            return Relief(0, "the reference already lives in host memory (trainer.device=cpu): offloading frees "
                             "nothing")
        if self.config.worker.ref.offload.params:
            return Relief(0, "the reference is already offloaded (worker.ref.offload.params=true)")
        return Relief(0, "FSDP2 fixes offload when the model is sharded: set worker.ref.offload.params=true for the "
                         "next launch (easytrain plan shows what it saves per GPU)")

    def halve_micro_batch(self, resources: set[str]) -> Relief:
        """Halve the update micro batch (where the actor's activations and logits peak), or when padding-free
        its token budget (the driver plans micro batches from it); the planner prices it: the effect shows at the next update's peak, so the figure is
        planned, not measured."""
        assert self.roles is not None and self.forward is not None
        from easytrain.config import with_overrides
        from easytrain.memory.planner import worker_bytes

        forward, sft = self.forward, self.config.trainer.task == "sft"
        phase = "forward_backward" if sft else "update"
        if forward.packed:  # the driver packs micro batches up to this budget
            key, size = "worker.actor.max_token_len_per_device", forward.budget
            floor = self.config.data.max_prompt_length + self.config.data.max_response_length
            if size // 2 < floor:
                return Relief(0, f"{key}={size} cannot halve: one sample may hold {floor} tokens")
        else:
            key, size = "worker.actor.micro_batch_size_per_device_for_update", forward.update_size
            if size <= 1:
                return Relief(0, "the update micro batch is already 1")
        now = forward.overrides()
        before = worker_bytes(with_overrides(self.config, now), "actor", phase)
        after = worker_bytes(with_overrides(self.config, {**now, key: size // 2}), "actor", phase)
        if forward.packed:  # the driver plans every micro batch from these: the next update follows
            forward.budget = size // 2
        else:
            forward.update_size = size // 2
        return Relief(0, f"{key} {size} -> {size // 2} from the next update on (until the run restarts)",
                      applied=True, planned=max(0, before - after))

    # ------------------------------------------------------------------ hard stop

    def explain(self, pressure: list[str], metrics: dict[str, float]) -> str:
        """Why the run stops: where, what grew, and the planner's changes that lower the peak."""
        message = f"memory: {'; '.join(pressure)}; {self.watchdog.describe_growth()}"
        return f"{message}; {self.planner_fixes(metrics)}"

    def planner_fixes(self, metrics: dict[str, float], count: int = 3) -> str:
        """Ask the planner with the pressure seen: its capacity is scaled so the planned peak fills the node
        (or GPU) as much as the samplers saw, and it names the single changes that lower that side's peak."""
        from dataclasses import replace

        from easytrain.memory.planner import GB, capacity_of, plan
        from easytrain.memory.suggest import suggestions
        from easytrain.models.shapes import hf_config_for

        try:
            hf_config = hf_config_for(self.config.model)
            if hf_config is None:
                return "no planner advice (the model's config.json is not available)"
            base = plan(self.config, hf_config)
            capacity = capacity_of(self.config)
            ram = metrics.get("memory/node_ram_fraction_max", 0.0)
            gpu = metrics.get("memory/gpu_held_fraction_max", metrics.get("memory/gpu_fraction_max", 0.0))
            if ram > 0:
                capacity = replace(capacity, node_ram=int(base.host_peak / ram / capacity.ray_threshold))
            if gpu > 0 and base.on_gpu:
                capacity = replace(capacity, gpu_bytes=int(base.device_peak / gpu))
            advice = suggestions(self.config, plan(self.config, hf_config, capacity), hf_config)
        except Exception:  # noqa: BLE001 - the stop must not fail on its advice
            logger.exception("planner suggestions failed")
            return "no planner advice (the planner failed; see the log)"
        on_gpu = self.config.trainer.device == "cuda"
        advice = [a for a in advice  # lowers the side under pressure by at least 1% of its planned peak
                  if (ram >= gpu and a.host_delta < -0.01 * base.host_peak)
                  or (gpu > ram and (a.device_delta < -0.01 * base.device_peak
                                     or any(v < 0 for v in a.phase_deltas.values())))]
        if not advice:
            return (f"the planner has no change that lowers this config's own peak (it plans "
                    f"{base.host_peak / GB:.1f} GB per node): what grew is outside what it prices")
        return "config changes that lower the peak (easytrain plan): " + "; ".join(
            a.describe(on_gpu) for a in advice[:count])

    def close(self, plot: bool) -> Any:
        return self.watchdog.close(plot)
