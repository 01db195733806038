"""The GRPO driver (single controller): one worker-group call per phase, each timed.

    generate -> reward (in the background) -> reference log-probs -> old log-probs
    -> advantages -> update -> weight sync

The driver holds prompts, token ids, rewards and advantages; models live in
the worker groups. Run it through ``python -m easytrain.main``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from easytrain.algorithms.advantages import compute_advantages, token_advantages
from easytrain.algorithms.kl import KLController, kl_penalty
from easytrain.config.schema import Config
from easytrain.distributed.batch import Batch
from easytrain.distributed.checkpoint import rng_state, set_rng_state
from easytrain.distributed.group import WorkerError
from easytrain.trainer.checkpoint import (ACTOR, PREFIX, CheckpointWriter, check_compatible, check_resume,
                                          checkpoint_root, latest, model_signature)
from easytrain.trainer.signals import resume_hint, stop_on_sigterm
from easytrain.trainer.data import RLData
from easytrain.trainer.metrics import MetricsLogger, PhaseTimer
from easytrain.trainer.relief import MemoryGuard
from easytrain.trainer.roles import Roles, build_roles
from easytrain.trainer.sampling import informative_count, keep_informative
from easytrain.trainer.stats import log_prob_agreement, reduce_update_metrics, response_metrics, reward_metrics

logger = logging.getLogger(__name__)


class Stopped(Exception):
    """The run stopped on request (SIGTERM, the watchdog) after saving a checkpoint."""

    def __init__(self, reason: str, step: int, checkpoint: Optional[Path]) -> None:
        super().__init__(f"stopped at step {step} ({reason}); checkpoint {checkpoint or 'none (saving is off)'}")
        self.reason, self.step, self.checkpoint = reason, step, checkpoint


class RunFailed(Exception):
    """Workers died more often than ``trainer.max_failures`` allows; the message says how to resume."""


class RLTrainer:
    def __init__(self, config: Config, data: Optional[RLData] = None) -> None:
        self.config = config
        t = config.trainer
        resume = check_resume(config)  # an incompatible checkpoint is refused before any worker starts
        self.data = data or RLData(config)
        self.total_steps = self.data.total_steps()
        self.fresh_data_state = self.data.loader.state_dict()
        a = config.algorithm
        self.kl = KLController(a.kl_coef, a.kl_type == "adaptive", a.kl_target, a.kl_horizon)
        steps_per_rollout = config.data.rollout_batch_size // config.worker.actor.global_batch_size
        self.optimizer_steps = self.total_steps * steps_per_rollout * config.worker.actor.ppo_epochs
        self.roles: Roles = build_roles(config, self.optimizer_steps)
        self.metrics = MetricsLogger(t.output_dir, t.loggers, t.experiment_name)
        self.checkpoints = CheckpointWriter(checkpoint_root(t.output_dir), t.save_limit)
        self.on_policy = config.worker.actor.ppo_epochs == 1 and steps_per_rollout == 1
        self.step, self.saved_step = 0, -1
        self.spans: list[tuple[str, float, float]] = []
        self.worker_readings: list[dict[str, Any]] = []
        self.stop_reason: Optional[str] = None
        self.save_requested = False
        self.guard = MemoryGuard(config, t.output_dir) if config.watchdog.enabled else None
        if self.guard is not None:
            self.guard.register(self.roles)
        self.restore(resume)

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
            first = self.validate()
            if t.val_only:
                return first
        bar = tqdm(total=self.total_steps, initial=self.step, desc="GRPO", unit="step")
        while self.step < self.total_steps:
            self.step += 1
            metrics = self.train_step(self.prompts)
            if self.guard is not None:  # pressure is judged at the step boundary, where relief and saving can run
                watched, stop = self.guard.after_step(self.step, self.spans, self.worker_readings)
                metrics.update(watched)
                if stop is not None:
                    self.request_stop(stop)
            self.metrics.log(self.step, metrics)
            if self.save_requested or (t.save_freq > 0 and self.step % t.save_freq == 0):
                self.save()
            if self.stop_reason is not None:
                raise Stopped(self.stop_reason, self.step, self.save())
            if t.val_freq > 0 and self.step % t.val_freq == 0 and self.step < self.total_steps:
                self.validate()
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        bar.close()
        final_checkpoint = self.save()
        final = self.validate()
        if t.export_final and final_checkpoint is not None:
            from easytrain.trainer.export import export

            export(final_checkpoint, Path(t.output_dir) / "hf", merge=t.export_merge)
        return final

    def train_step(self, prompts: Iterator[Batch]) -> dict[str, float]:
        timer, start = PhaseTimer(), time.perf_counter()
        batch, scores, sampling = self.rollout(prompts, timer)
        if self.roles.rollout_sleeps:  # hand the device to the training roles until the next sync
            with timer("sleep"):
                self.roles.rollout.call("sleep")
        with timer("old_log_probs"):
            if not (self.on_policy and self.config.worker.actor.reuse_log_probs_on_policy):
                batch = batch.union(self.roles.actor.call("compute_log_probs", batch))
        with timer("advantages"):
            batch = self.add_advantages(batch, scores)
        with timer("update"):
            update = self.roles.actor.call("update", self.for_update(batch), self.kl.coef)
        with timer("sync"):
            synced = self.roles.transport.sync(self.roles.actor, self.roles.rollout)
        metrics = {**reward_metrics(scores), **response_metrics(batch, self.config.data.max_response_length),
                   **reduce_update_metrics(update), **sampling, **synced, **log_prob_agreement(batch)}
        self.kl.update(metrics.get("actor/kl_loss", 0.0), len(batch))
        metrics["actor/kl_coef"] = self.kl.coef
        metrics.update(timer.times)
        metrics["time/step"] = time.perf_counter() - start
        metrics["perf/tokens_per_s"] = float(batch["response_mask"].sum()) / max(metrics["time/generate"], 1e-9)
        metrics.update(self.memory())
        self.spans = timer.spans
        return metrics

    # ------------------------------------------------------------------ phases

    def rollout(self, prompts: Iterator[Batch],
                timer: PhaseTimer) -> tuple[Batch, dict[str, torch.Tensor], dict[str, float]]:
        """Generate and score; with dynamic sampling, keep groups with signal and refill (DAPO)."""
        first = next(prompts)
        uids = list(first.meta["uids"])
        batch, scores = self.generate_and_score(first, timer)
        if not self.config.algorithm.dynamic_sampling:
            self.metrics.log_order(self.step, uids)
            return batch, scores, {}
        n, target = self.config.worker.rollout.n, self.config.data.rollout_batch_size
        rounds = [(batch, scores)]
        while (informative_count(rounds, n) < target
               and len(rounds) <= self.config.algorithm.max_sampling_retries):
            more = next(prompts)
            uids += list(more.meta["uids"])
            rounds.append(self.generate_and_score(more, timer, call=len(rounds)))
        self.metrics.log_order(self.step, uids)
        batch, scores = keep_informative(rounds, n, target)
        return batch, scores, {"sampling/rounds": float(len(rounds)),
                               "sampling/informative_groups": float(min(informative_count(rounds, n), target))}

    def generate_and_score(self, prompts: Batch, timer: PhaseTimer, validate: bool = False,
                           call: int = 0) -> tuple[Batch, dict[str, torch.Tensor]]:
        with timer("generate"):
            batch = self.roles.rollout.call("generate", prompts, self.step, validate, call)
        texts = self.data.decode(batch)
        pending = self.roles.rewards.submit(texts, batch.meta["answers"])
        reference = self.roles.reference
        if not validate and reference is not None:
            with timer("ref"):  # runs while the reward actors score
                batch = batch.union(reference.call("compute_ref_log_probs", batch))
        with timer("reward"):
            scores, errors = self.roles.rewards.collect(pending)
        table = {key: torch.tensor([s.get(key, 0.0) for s in scores]) for key in scores[0]}
        table["errors"] = torch.full((len(scores),), float(errors) / max(1, len(scores)))
        batch.meta["texts"] = texts
        return batch, table

    def add_advantages(self, batch: Batch, scores: dict[str, torch.Tensor]) -> Batch:
        a, n = self.config.algorithm, self.config.worker.rollout.n
        rewards = scores["overall"].to(torch.float32)
        mask = batch["response_mask"]
        if not a.use_kl_loss and "ref_log_probs" in batch:  # KL in the reward, of the actor's log-probs
            policy = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
            kl = kl_penalty(policy, batch["ref_log_probs"], a.kl_penalty)
            rewards = rewards - self.kl.coef * (kl * mask).sum(-1)
        groups = torch.arange(len(batch)) // n
        advantages = compute_advantages(a.adv_estimator, rewards, groups, a.norm_adv_by_std)
        return batch.union(Batch({"advantages": token_advantages(advantages, mask)}))

    def for_update(self, batch: Batch) -> Batch:
        per_step = self.config.worker.actor.global_batch_size * self.config.worker.rollout.n
        return batch.interleave_for_ranks(per_step, self.roles.actor.world_size)

    def validate(self) -> dict[str, float]:
        timer = PhaseTimer()
        all_scores: list[dict[str, torch.Tensor]] = []
        samples: list[dict[str, Any]] = []
        for call, prompts in enumerate(self.data.val_batches()):
            batch, scores = self.generate_and_score(prompts, timer, validate=True, call=call)
            all_scores.append(scores)
            for i in range(len(batch)):
                if len(samples) < self.config.trainer.log_samples:
                    samples.append({"uid": batch.meta["uids"][i], "response": batch.meta["texts"][i],
                                    "answer": batch.meta["answers"][i], "score": float(scores["overall"][i])})
        merged = {k: torch.cat([s[k] for s in all_scores]) for k in all_scores[0]}
        metrics = {f"val/{k}": v for k, v in reward_metrics(merged).items()}
        metrics["val/time"] = timer.times.get("time/generate", 0.0) + timer.times.get("time/reward", 0.0)
        if samples:
            self.metrics.write_samples(self.step, samples)
        self.metrics.log(self.step, metrics)
        return metrics

    def memory(self) -> dict[str, float]:
        """Each role's largest per-worker reading; all workers are asked at once. Their in-worker readings
        (RSS, torch allocator) are kept for the memory watchdog."""
        groups = {"actor": self.roles.actor, "ref": self.roles.ref, "rollout": self.roles.rollout}
        pending = {name: group.submit("memory") for name, group in groups.items() if group is not None}
        out, self.worker_readings = {}, []
        for name, calls in pending.items():
            readings = groups[name].collect(calls)  # type: ignore[union-attr]
            self.worker_readings += [r.pop("watch") for r in readings]
            for key in readings[0]:
                out[f"memory/{name}_{key}_max"] = max(r[key] for r in readings)
        return out

    # ------------------------------------------------------------------ checkpoints and recovery

    def request_stop(self, reason: str) -> None:
        """Save at the end of the current step and stop (SIGTERM, the watchdog's hard threshold)."""
        if self.stop_reason is None:
            logger.warning("%s: saving a checkpoint at the end of the current step and stopping", reason)
        self.stop_reason = reason

    def request_checkpoint(self) -> None:
        """Save at the end of the current step and go on (the watchdog's request)."""
        self.save_requested = True

    def save(self) -> Optional[Path]:
        """Checkpoint the current step (once); None when saving is off (trainer.save_freq=0)."""
        self.save_requested = False
        if self.config.trainer.save_freq == 0 or self.step == 0:
            return None
        if self.saved_step == self.step:
            return self.checkpoints.root / f"{PREFIX}{self.step}"
        start = time.perf_counter()
        tmp = self.checkpoints.begin(self.step)
        self.roles.actor.call("save_checkpoint", str(tmp / ACTOR))
        state = {"step": self.step, "data": self.data.loader.state_dict(), "kl": self.kl.state_dict(),
                 "rng": rng_state(), "actor_world_size": self.roles.actor.world_size,
                 "model_signature": model_signature(self.config)}
        folder = self.checkpoints.commit(tmp, self.step, state, OmegaConf.to_yaml(OmegaConf.structured(self.config)))
        self.saved_step = self.step
        logger.info("checkpoint %s (%.1f s)", folder, time.perf_counter() - start)
        return folder

    def restore(self, folder: Optional[Path]) -> None:
        """Continue from ``folder`` (None: from the start): weights and optimizer, data position, KL, RNG;
        then hand the restored weights to the rollout engine."""
        if hasattr(self, "prompts"):
            self.prompts.close()  # stops the previous loader (and its worker processes)
        if folder is None:
            self.step, self.saved_step = 0, -1
            self.data.loader.load_state_dict(self.fresh_data_state)
        else:
            state = check_compatible(folder, self.config)
            self.roles.actor.call("load_checkpoint", str(folder / ACTOR))
            self.step = self.saved_step = int(state["step"])
            self.data.loader.load_state_dict(state["data"])
            self.kl.load_state_dict(state["kl"])
            set_rng_state(state["rng"])
            self.roles.transport.sync(self.roles.actor, self.roles.rollout)
            logger.info("resumed from %s: step %d of %d (saved by %d actor rank(s), now %d)", folder, self.step,
                        self.total_steps, state["actor_world_size"], self.roles.actor.world_size)
        self.metrics.rewind(self.step)
        self.prompts = self.data.train_batches()

    def restart(self) -> None:
        """Tear every worker group down, build them again and resume from the latest checkpoint."""
        self.roles.shutdown()
        self.roles = build_roles(self.config, self.optimizer_steps)
        if self.guard is not None:
            self.guard.register(self.roles)
        self.restore(latest(self.checkpoints.root) if self.checkpoints.root.is_dir() else None)

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
        if hasattr(self, "prompts"):
            self.prompts.close()
        self.metrics.close()
        if self.guard is not None:
            self.guard.close(plot=self.config.watchdog.plot)
        self.roles.shutdown()
