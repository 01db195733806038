"""What every trainer does around its steps: checkpoints, resume, recovery from dead workers, the
memory watchdog at step boundaries, stopping on request.

A trainer (RL, SFT) subclasses :class:`Trainer` and supplies its roles
(:meth:`build_roles`), one step (:meth:`train_step`), validation
(:meth:`validate`) and the driver state its checkpoints carry beyond the
actor's (:meth:`driver_state` / :meth:`load_driver_state`).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from omegaconf import OmegaConf
from tqdm import tqdm

from easytrain.config.schema import Config
from easytrain.distributed.checkpoint import rng_state, set_rng_state
from easytrain.distributed.group import WorkerError
from easytrain.memory.flag import MemoryStop
from easytrain.memory.data_shape import DataCosts
from easytrain.memory.plan_check import PlanCheck
from easytrain.trainer.checkpoint import (ACTOR, CONFIG_FILE, PREFIX, CheckpointError, CheckpointWriter,
                                          PendingCheckpoint, check_compatible, checkpoint_root, is_complete, latest,
                                          disk_full, model_signature, save_failed, step_of)
from easytrain.trainer.metrics import MetricsLogger
from easytrain.trainer.ray_metrics import RayMetrics
from easytrain.trainer.micro_batches import Forward
from easytrain.trainer.relief import MemoryGuard
from easytrain.trainer.roles import Roles
from easytrain.trainer.signals import resume_hint, stop_on_sigterm

logger = logging.getLogger(__name__)


class StepAborted(MemoryStop):
    """Hard memory pressure before a step's update, seen by the driver: the step ends unfinished (its weights
    are still the last step's) and the run saves that last step and stops. A :class:`MemoryStop` raised by a
    worker (a generation that saw the node's hard flag) ends the step the same way."""


class Stopped(Exception):
    """The run stopped on request (SIGTERM, the watchdog) after saving a checkpoint."""

    def __init__(self, reason: str, step: int, checkpoint: Optional[Path]) -> None:
        super().__init__(f"stopped at step {step} ({reason}); checkpoint {checkpoint or 'none (saving is off)'}")
        self.reason, self.step, self.checkpoint = reason, step, checkpoint


@dataclass
class StepResult:
    """What one training step hands the loop: its metrics, when each of its phases ran (the watchdog's
    timeline) and the workers' own memory readings (for the watchdog's judgement)."""

    metrics: dict[str, float]
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    readings: list[dict[str, Any]] = field(default_factory=list)


class RunFailed(Exception):
    """Workers died more often than ``trainer.max_failures`` allows; the message says how to resume."""


def ray_metrics(run_name: str) -> Optional[RayMetrics]:
    """Step metrics as Ray gauges (dashboard, Prometheus) when this process is connected to Ray."""
    import ray

    return RayMetrics(run_name) if ray.is_initialized() else None


class Trainer:
    name = "train"
    """Progress bar label."""
    headline = "loss"
    """The step metric the progress bar shows."""

    roles: Roles
    forward: Forward
    """The run's micro batch layout (built with the roles); its sizes are the run's only mutable settings."""
    total_steps: int
    batches: Iterator[Any]

    def __init__(self, config: Config, loader: Any) -> None:
        t = config.trainer
        self.config, self.loader = config, loader
        self.fresh_data_state = loader.state_dict()
        self.metrics = MetricsLogger(t.output_dir, t.loggers, t.experiment_name, t.project_name,
                                     OmegaConf.to_container(OmegaConf.structured(config)))  # type: ignore[arg-type]
        (Path(t.output_dir) / CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.structured(config)))
        self.ray_metrics = ray_metrics(t.experiment_name)
        if self.ray_metrics is not None:
            self.metrics.add(self.ray_metrics)
        self.checkpoints = CheckpointWriter(checkpoint_root(t.output_dir), t.save_limit)
        self.step, self.saved_step = 0, -1
        self.pending_save: Optional[PendingCheckpoint] = None
        """A checkpoint being written in the background (trainer.checkpoint_async), published once written."""
        self.stop_reason: Optional[str] = None
        self.guard = MemoryGuard(config, t.output_dir) if config.watchdog.enabled else None
        self.plan_check = PlanCheck.of(config, self.guard.watchdog.write if self.guard is not None else None,
                                       self.data_costs())

    def start(self, resume: Optional[Path]) -> None:
        """Build the roles, register them with the watchdog, continue from ``resume`` (None: the start)."""
        self.roles = self.build_roles()
        if self.guard is not None:
            self.guard.register(self.roles, self.forward)
        try:
            self.restore(resume)
        except BaseException:  # nothing to resume from: the workers, their placement and the samplers go too
            self.roles.shutdown()
            if self.guard is not None:
                self.guard.close(plot=False)
            raise
        self.record_peaks("start")

    # ------------------------------------------------------------------ what a trainer supplies

    def build_roles(self) -> Roles:
        raise NotImplementedError

    def note(self, record: dict[str, Any]) -> None:
        """``record`` of this step into ``memory.jsonl`` (with the watchdog on), at once: a step that fails
        after it still leaves it."""
        if self.guard is not None:
            self.guard.watchdog.write({**record, "step": self.step})

    def data_costs(self) -> Optional[DataCosts]:
        """The rows the run read, to price its plan check on (None: on the data limits)."""
        return None

    def train_step(self) -> StepResult:
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        raise NotImplementedError

    def abandoned_at(self, boundary: dict[str, Any]) -> dict[str, Any]:
        """The data position and RNG a checkpoint of an abandoned step takes: by default where the last finished
        step ended (``boundary``)."""
        return boundary

    def driver_state(self, folder: Path) -> dict[str, Any]:
        """What a checkpoint keeps of the driver beyond the actor's state: JSON for the trainer state; larger
        things as files the trainer writes into ``folder`` (the checkpoint being written)."""
        return {}

    def load_driver_state(self, state: dict[str, Any], folder: Path) -> None:
        """Driver state of the checkpoint in ``folder``; the actor's weights are already loaded."""

    def new_batches(self) -> Iterator[Any]:
        raise NotImplementedError

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, float]:
        """Train to the last step; recover from worker deaths up to ``trainer.max_failures`` times."""
        failures = 0
        with stop_on_sigterm(self.request_stop):
            while True:
                try:
                    return self._fit()
                except WorkerError as err:
                    dead = self.wait_for_dead_workers()
                    if not dead:
                        raise  # a worker raised: retrying the same step would fail the same way
                    failures += 1
                    report = f"{err} (dead: {', '.join(dead)})"
                    if failures > self.config.trainer.max_failures:
                        raise RunFailed(f"{report}; {failures} failure(s), trainer.max_failures="
                                        f"{self.config.trainer.max_failures}. {resume_hint(self.config)}") from err
                    logger.error("%s; recreating the worker groups and resuming from the latest checkpoint "
                                 "(failure %d of trainer.max_failures=%d)", report, failures,
                                 self.config.trainer.max_failures)
                    self.restart()

    def _fit(self) -> dict[str, float]:
        t = self.config.trainer
        if self.step == 0 and (t.val_before_train or t.val_only):
            first = self.validate_or_stop()
            self.record_peaks("validation")
            if t.val_only:
                return first
        bar = tqdm(total=self.total_steps, initial=self.step, desc=self.name, unit="step")
        while self.step < self.total_steps:
            boundary = {"data": self.loader.state_dict(), "rng": rng_state()}  # what the last step ended with
            self.step += 1
            try:
                result = self.train_step()
            except MemoryStop as abort:  # nothing of this step is in the weights: the last step is the state
                reason = self.stop_reason_of(abort, "generate")
                self.step -= 1
                raise Stopped(reason, self.step, self.save(boundary=self.abandoned_at(boundary))) from None
            self.record_peaks("step")
            metrics = result.metrics
            metrics["actor/update_micro"] = float(self.forward.update_micro)
            if self.guard is not None:  # pressure is judged at the step boundary, where relief and saving can run
                watched, stop = self.guard.after_step(self.step, result.spans, result.readings)
                metrics.update(watched)
                if stop is not None:
                    self.request_stop(stop)
            self.metrics.log(self.step, metrics)
            self.finish_save(wait=False)
            if t.save_freq > 0 and self.step % t.save_freq == 0:
                self.save(background=t.checkpoint_async)
            if self.stop_reason is not None:
                raise Stopped(self.stop_reason, self.step, self.save())
            if t.val_freq > 0 and self.step % t.val_freq == 0 and self.step < self.total_steps:
                self.validate_or_stop()
                self.record_peaks("validation")
            bar.update(1)
            bar.set_postfix({self.headline: f"{metrics.get(self.headline, float('nan')):.3f}"})
        bar.close()
        final_checkpoint = self.save()
        self.record_peaks("save")
        final = self.validate_or_stop()
        self.record_peaks("validation")
        if t.export_final and final_checkpoint is not None:
            from easytrain.trainer.export import export

            export(final_checkpoint, Path(t.output_dir) / "hf", merge=t.export_merge,
                   trust_remote_code=self.config.model.trust_remote_code)
        return final

    def memory(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Each role's largest per-worker reading as metrics, and every worker's in-worker readings (RSS, torch
        allocator) for the memory watchdog; all workers are asked at once."""
        groups = self.roles.processes()
        pending = {name: group.submit("memory") for name, group in groups.items()}
        out: dict[str, float] = {}
        watched: list[dict[str, Any]] = []
        for name, calls in pending.items():
            readings = groups[name].collect(calls)
            watched += [r.pop("watch") for r in readings]
            for key in readings[0]:
                out[f"memory/{name}_{key}_max"] = max(r[key] for r in readings)
        if self.ray_metrics is not None:
            self.ray_metrics.workers(watched)
        return out, watched

    def record_peaks(self, context: str) -> None:
        """Every worker's peaks per call since the last drain, against the plan (:mod:`easytrain.memory.plan_check`):
        ``memory.jsonl`` gets them, the run log the plan misses."""
        if self.plan_check is None:
            return
        groups = self.roles.processes()
        pending = [(group, group.submit("phase_peaks")) for group in groups.values()]
        readings = [r for group, calls in pending for r in group.collect(calls)]
        self.plan_check.follow(self.config, self.forward.overrides())
        self.plan_check.record(self.step, context, readings)

    # ------------------------------------------------------------------ checkpoints and recovery

    def request_stop(self, reason: str) -> None:
        """Save at the end of the current step and stop (SIGTERM, the watchdog's hard threshold)."""
        if self.stop_reason is None:
            logger.warning("%s: saving a checkpoint at the end of the current step and stopping", reason)
        self.stop_reason = reason

    def check_pressure(self, phase: str, before_update: bool = True) -> None:
        """Node RAM between two phases of a step (the watchdog's samplers): soft pressure is relieved now; hard
        pressure before the update ends the step unfinished (:class:`StepAborted`), from the update on the step
        finishes, saves and stops."""
        if self.guard is None or self.stop_reason is not None:
            return
        stop = self.guard.between_phases(self.step, phase)
        if stop is not None and before_update:
            raise StepAborted(stop)
        if stop is not None:
            self.request_stop(stop)

    def watch_phase(self, phase: str) -> Optional[Callable[[], None]]:
        """What the driver calls while it waits for ``phase``'s workers (every watchdog.sample_period_s): hard
        pressure raises :class:`StepAborted` at once, the caller stops what it waits for (a reward worker
        whose code grows is killed: it holds no state). None without a watchdog."""
        guard = self.guard
        if guard is None:
            return None

        def check() -> None:
            stop = guard.during_phase(self.step, phase)
            if stop is not None:
                raise StepAborted(stop)

        return check

    def stop_reason_of(self, stop: MemoryStop, phase: str) -> str:
        """The run's stop line for a :class:`MemoryStop`: the driver's own, or a worker's, explained (where,
        what grew, what to change) and recorded in memory.jsonl."""
        if isinstance(stop, StepAborted) or self.guard is None:
            return stop.reason
        return self.guard.stopped_during(self.step, phase, stop.reason)

    def validate_or_stop(self) -> dict[str, float]:
        """Validation; a generation stopped by hard pressure saves the step just finished and stops."""
        try:
            return self.validate()
        except MemoryStop as stop:
            raise Stopped(self.stop_reason_of(stop, "validation"), self.step, self.save()) from None

    def save(self, background: bool = False, boundary: Optional[dict[str, Any]] = None) -> Optional[Path]:
        """Checkpoint the current step (once); None when saving is off (trainer.save_freq=0). ``background``: return
        once the workers staged their state and publish it at a later step boundary, once written (also None).
        ``boundary``: the data position and RNG the step ended with (a later step was begun and abandoned)."""
        if self.config.trainer.save_freq == 0 or self.step == 0:
            return None
        self.finish_save(wait=True)  # one checkpoint in flight at a time, published in order
        if self.saved_step == self.step:
            return self.checkpoints.root / f"{PREFIX}{self.step}"
        start = time.perf_counter()
        tmp = self.checkpoints.begin(self.step)
        with self.no_space_fails(tmp, self.step):
            calls = self.roles.actor.call("save_checkpoint", str(tmp / ACTOR), background)
        ended = boundary or {"data": self.loader.state_dict(), "rng": rng_state()}
        state = {"step": self.step, "task": self.config.trainer.task, "strategy": self.config.worker.actor.strategy,
                 "data": ended["data"], "rng": ended["rng"],
                 "actor_world_size": self.roles.actor.world_size, "model_signature": model_signature(self.config),
                 **self.driver_state(tmp)}
        pending = PendingCheckpoint(tmp, self.step, state, OmegaConf.to_yaml(OmegaConf.structured(self.config)),
                                    start, blocked_s=time.perf_counter() - start)
        self.saved_step = self.step
        if not background:
            with self.no_space_fails(tmp, self.step):
                return self.publish(pending, write_s=max(c["call_s"] for c in calls))
        self.pending_save = pending
        logger.info("checkpoint of step %d: staged in %.1f s, writing in the background (host RAM: a copy of each "
                    "rank's state until written)", self.step, pending.blocked_s)
        return None

    def finish_save(self, wait: bool) -> None:
        """Publish the background checkpoint once every actor rank's write has finished (``wait``: block until
        then). A failed write is logged and raised, and its folder is never published."""
        pending = self.pending_save
        if pending is None or not (wait or all(self.roles.actor.call("checkpoint_written"))):
            return
        self.pending_save = None
        start = time.perf_counter()
        with self.no_space_fails(pending.tmp, pending.step):
            try:
                writes = self.roles.actor.call("wait_checkpoint")
            except WorkerError:
                logger.error("writing the checkpoint of step %d failed; %s is not published (the last published "
                             "one stays the latest)", pending.step, pending.tmp.name)
                raise
            pending.blocked_s += time.perf_counter() - start
            self.publish(pending, write_s=max((w.get("write_s", 0.0) for w in writes), default=0.0),
                         staged_gb=max((w.get("staged_gb", 0.0) for w in writes), default=0.0))

    @contextmanager
    def no_space_fails(self, tmp: Path, step: int) -> Iterator[None]:
        """A checkpoint write that finds the disk full ends the run in one line (:class:`RunFailed`): the
        half-written folder goes, the last published checkpoint is named intact."""
        try:
            yield
        except (OSError, WorkerError) as err:
            if not disk_full(err, self.checkpoints.root):
                raise
            raise RunFailed(f"{save_failed(self.checkpoints.root, step, tmp, err)}. {resume_hint(self.config)}") from None

    def publish(self, pending: PendingCheckpoint, write_s: float, staged_gb: float = 0.0) -> Path:
        """Commit a checkpoint whose shards every rank has written; log and record what it cost the step loop (and,
        written in the background, the host memory its largest rank staged)."""
        start = time.perf_counter()
        written = self.roles.actor.call("checkpoint_files", str(pending.tmp))  # what each rank's node sees
        folder = self.checkpoints.commit(pending.tmp, pending.step, pending.state, pending.config_yaml, written)
        blocked = pending.blocked_s + time.perf_counter() - start
        staged = f", {staged_gb:.2f} GB staged per rank" if staged_gb else ""
        logger.info("checkpoint %s (step loop blocked %.1f s, shards written in %.1f s%s)", folder, blocked, write_s,
                    staged)
        record = {"checkpoint/step": pending.step, "checkpoint/blocked_s": blocked, "checkpoint/write_s": write_s}
        self.metrics.log(self.step, {**record, **({"checkpoint/staged_gb": staged_gb} if staged_gb else {})})
        return folder

    def restore(self, folder: Optional[Path]) -> None:
        """Continue from ``folder`` (None: from the start): weights and optimizer, data position, RNG and the
        trainer's own state."""
        if hasattr(self, "batches"):
            self.batches.close()  # type: ignore[attr-defined]  # stops the previous loader (and its processes)
        if folder is None:
            self.step, self.saved_step = 0, -1
            self.loader.load_state_dict(self.fresh_data_state)
        else:
            state = check_compatible(folder, self.config)
            try:
                self.roles.actor.call("load_checkpoint", str(folder / ACTOR))
            except WorkerError as err:  # a shard unreadable (truncated, a disk error): the step before it, if any
                older = self.fallback_from(folder, err)
                return self.restore(older)
            self.step = self.saved_step = int(state["step"])
            self.loader.load_state_dict(state["data"])
            set_rng_state(state["rng"])
            self.load_driver_state(state, folder)
            logger.info("resumed from %s: step %d of %d (saved by %d actor rank(s), now %d)", folder, self.step,
                        self.total_steps, state["actor_world_size"], self.roles.actor.world_size)
        self.metrics.rewind(self.step)
        self.batches = self.new_batches()

    def fallback_from(self, folder: Path, err: Exception) -> Path:
        """The newest complete checkpoint older than ``folder``, which failed to load with ``err``; one line
        naming ``folder`` when there is none, or when ``trainer.resume`` named it (never another in its place)."""
        reason = str(err).strip().splitlines()[-1][:300] if str(err).strip() else type(err).__name__
        older = [f for f in self.checkpoints.root.glob(f"{PREFIX}*")
                 if is_complete(f) and step_of(f) < step_of(folder)] if self.checkpoints.root.is_dir() else []
        if self.config.trainer.resume not in ("auto", "off") or not older:
            raise CheckpointError(f"{folder} could not be loaded ({reason}); "
                                  + ("no earlier complete checkpoint in the run" if not older else
                                     f"resume from an earlier one, e.g. trainer.resume={max(older, key=step_of)}"))
        chosen = max(older, key=step_of)
        logger.warning("%s could not be loaded (%s); resuming from %s, the newest complete checkpoint before it",
                       folder, reason, chosen)
        return chosen

    def restart(self) -> None:
        """Tear every worker group down, build them again and resume from the latest checkpoint."""
        if self.pending_save is not None:  # its writers may be among the dead: never published
            logger.warning("the background checkpoint of step %d is dropped unpublished", self.pending_save.step)
            self.pending_save = None
        self.roles.shutdown()
        self.start(latest(self.checkpoints.root) if self.checkpoints.root.is_dir() else None)

    def wait_for_dead_workers(self, timeout_s: float = 30.0) -> list[str]:
        """Which workers are dead. A peer's failure (a broken collective) can reach the driver before Ray marks
        the dead one, which for a lost node takes its health checks (~15 s with Ray's defaults)."""
        deadline = time.monotonic() + timeout_s
        while True:
            dead = self.roles.dead_workers()
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.5)

    def close(self) -> None:
        if self.pending_save is not None:  # the run ended early (an error): publish it only if already written
            step = self.pending_save.step
            try:
                self.finish_save(wait=False)
            except Exception as err:  # noqa: BLE001 - the run's own error is the one to report
                logger.warning("the background checkpoint of step %d was not published: %s", step, err)
                self.pending_save = None
            if self.pending_save is not None:
                logger.warning("the background checkpoint of step %d was still being written when the run ended; "
                               "not published", step)
                self.pending_save = None
        if hasattr(self, "batches"):
            self.batches.close()  # type: ignore[attr-defined]
        self.metrics.close()
        if self.guard is not None:
            self.guard.close(plot=self.config.watchdog.plot)
        if hasattr(self, "roles"):
            self.roles.shutdown()
        self.write_report()

    def write_report(self) -> None:
        """Plots and index.html of the run folder (after the memory timeline, which they show); a failure is
        a warning, never the run's."""
        run_dir = Path(self.config.trainer.output_dir)
        if not (run_dir / "metrics.jsonl").is_file():
            return
        try:
            from easytrain.trainer.report import write_report

            write_report(run_dir)
        except Exception as err:  # noqa: BLE001 - the report is a by-product; the run's result stands
            logger.warning("run report not written: %s: %s", type(err).__name__, err, exc_info=True)
