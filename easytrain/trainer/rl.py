"""The GRPO driver (single controller): one worker-group call per phase, each timed.

    generate -> reward (in the background) -> reference log-probs -> old log-probs
    -> advantages -> update -> weight sync

The driver holds prompts, token ids, rewards and advantages; models live in
the worker groups. Run it through ``python -m easytrain.main``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator, Optional

import torch
from tqdm import tqdm

from easytrain.algorithms.advantages import compute_advantages, token_advantages
from easytrain.algorithms.kl import KLController, kl_penalty
from easytrain.config.schema import Config
from easytrain.distributed.batch import Batch
from easytrain.trainer.data import RLData
from easytrain.trainer.metrics import MetricsLogger, PhaseTimer
from easytrain.trainer.roles import Roles, build_roles
from easytrain.trainer.sampling import informative_count, keep_informative
from easytrain.trainer.stats import log_prob_agreement, reduce_update_metrics, response_metrics, reward_metrics

logger = logging.getLogger(__name__)


class RLTrainer:
    def __init__(self, config: Config, data: Optional[RLData] = None) -> None:
        self.config = config
        self.data = data or RLData(config)
        self.total_steps = self.data.total_steps()
        a = config.algorithm
        self.kl = KLController(a.kl_coef, a.kl_type == "adaptive", a.kl_target, a.kl_horizon)
        steps_per_rollout = config.data.rollout_batch_size // config.worker.actor.global_batch_size
        self.roles: Roles = build_roles(config, self.total_steps * steps_per_rollout * config.worker.actor.ppo_epochs)
        self.metrics = MetricsLogger(config.trainer.output_dir, config.trainer.loggers, config.trainer.experiment_name)
        self.on_policy = config.worker.actor.ppo_epochs == 1 and steps_per_rollout == 1
        self.step = 0

    # ------------------------------------------------------------------ loop

    def fit(self) -> dict[str, float]:
        t = self.config.trainer
        if t.val_before_train or t.val_only:
            first = self.validate()
            if t.val_only:
                return first
        bar = tqdm(total=self.total_steps, desc="GRPO", unit="step")
        prompts = self.data.train_batches()
        while self.step < self.total_steps:
            self.step += 1
            metrics = self.train_step(prompts)
            self.metrics.log(self.step, metrics)
            if t.val_freq > 0 and self.step % t.val_freq == 0 and self.step < self.total_steps:
                self.validate()
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        bar.close()
        return self.validate()

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
        return metrics

    # ------------------------------------------------------------------ phases

    def rollout(self, prompts: Iterator[Batch],
                timer: PhaseTimer) -> tuple[Batch, dict[str, torch.Tensor], dict[str, float]]:
        """Generate and score; with dynamic sampling, keep groups with signal and refill (DAPO)."""
        batch, scores = self.generate_and_score(next(prompts), timer)
        if not self.config.algorithm.dynamic_sampling:
            return batch, scores, {}
        n, target = self.config.worker.rollout.n, self.config.data.rollout_batch_size
        rounds = [(batch, scores)]
        while (informative_count(rounds, n) < target
               and len(rounds) <= self.config.algorithm.max_sampling_retries):
            rounds.append(self.generate_and_score(next(prompts), timer))
        batch, scores = keep_informative(rounds, n, target)
        return batch, scores, {"sampling/rounds": float(len(rounds)),
                               "sampling/informative_groups": float(min(informative_count(rounds, n), target))}

    def generate_and_score(self, prompts: Batch, timer: PhaseTimer,
                           validate: bool = False) -> tuple[Batch, dict[str, torch.Tensor]]:
        with timer("generate"):
            batch = self.roles.rollout.call("generate", prompts, self.step, validate)
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
        for prompts in self.data.val_batches():
            batch, scores = self.generate_and_score(prompts, timer, validate=True)
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
        """Each role's largest per-worker reading; all workers are asked at once."""
        groups = {"actor": self.roles.actor, "ref": self.roles.ref, "rollout": self.roles.rollout}
        pending = {name: group.submit("memory") for name, group in groups.items() if group is not None}
        out = {}
        for name, calls in pending.items():
            readings = groups[name].collect(calls)  # type: ignore[union-attr]
            for key in readings[0]:
                out[f"memory/{name}_{key}_max"] = max(r[key] for r in readings)
        return out

    def close(self) -> None:
        self.metrics.close()
        self.roles.shutdown()
