"""The GRPO driver (single controller): one worker-group call per phase, each timed.

    generate -> engine sleeps -> reference log-probs -> rewards -> old log-probs -> advantages -> update
    -> weight sync

(the reward workers score from the end of the generation, while the reference pass runs; the driver collects
the scores after it)

the order of :data:`easytrain.memory.phases.STEP`. The driver hands the device over itself: the engine sleeps
before the reference pass, its weights wake for the sync and its KV cache before the next generation
(:meth:`Roles.sleep_engine`, :meth:`Roles.wake_engine`; nothing where the engine cannot sleep).
With ``trainer.rollout_mode=one_step_off`` the step trains on the batch generated during the last step while
the engine generates the next one (:mod:`easytrain.trainer.ahead`).

The driver holds prompts, token ids, rewards and advantages; models live in
the worker groups. Run it through ``python -m easytrain.main``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from easytrain.algorithms.advantages import compute_advantages, token_advantages
from easytrain.algorithms.kl import KLController, kl_in_reward
from easytrain.config.schema import Config
from easytrain.distributed.batch import Batch
from easytrain.distributed.group import WorkerGroup
from easytrain.config.presets import RANDOM_PREFIX
from easytrain.distributed.group import Pending
from easytrain.memory.data_shape import DataCosts
from easytrain.memory.report import check_before_launch
from easytrain.trainer.ahead import Generated, importance_weights, load_generated, save_generated
from easytrain.trainer.asynchronous import AsyncRollouts, async_rollouts
from easytrain.trainer.base import RunFailed, StepResult, Stopped, Trainer
from easytrain.trainer.checkpoint import check_resume
from easytrain.trainer.data import RLData
from easytrain.trainer.micro_batches import Forward, largest_micro_batches, run_log_probs, run_update
from easytrain.trainer.metrics import PhaseTimer
from easytrain.trainer.roles import Roles, build_roles
from easytrain.trainer.sampling import informative_count, keep_informative
from easytrain.trainer.stats import log_prob_agreement, reduce_update_metrics, response_metrics, reward_metrics

logger = logging.getLogger(__name__)
__all__ = ["RLTrainer", "RunFailed", "Stopped", "with_prompt_visuals"]

Scoring = Callable[..., dict[str, torch.Tensor]]
"""Waits for the scores of a batch sent to the reward workers (``scoring(timer)``): the reward table."""


class RLTrainer(Trainer):
    name, headline = "GRPO", "reward/mean"

    def __init__(self, config: Config, data: Optional[RLData] = None) -> None:
        resume = check_resume(config)  # an incompatible checkpoint is refused before any worker starts
        self.data = data or RLData(config)
        if self.data.sampled_at_launch():  # every row read now: the plan on all of them, before any worker starts
            check_before_launch(config, self.data_costs())
        super().__init__(config, self.data.loader)
        self.total_steps = self.data.total_steps()
        a = config.algorithm
        self.kl = KLController(a.kl_coef, a.kl_type == "adaptive", a.kl_target, a.kl_horizon)
        steps_per_rollout = config.data.rollout_batch_size // config.worker.actor.global_batch_size
        self.optimizer_steps = self.total_steps * steps_per_rollout * config.worker.actor.ppo_epochs
        self.on_policy = config.worker.actor.ppo_epochs == 1 and steps_per_rollout == 1
        self.one_step_off = config.trainer.rollout_mode == "one_step_off"
        self.behind = config.trainer.rollout_mode in ("one_step_off", "async")
        """The step trains on tokens an older version of the weights sampled (the engine's log-probs are the
        behaviour policy's)."""
        self.ready: Optional[Generated] = None
        """one_step_off: the batch the next step trains on, generated during the last one."""
        self.partial: Optional[AsyncRollouts] = None
        """async: the partial rollouts and the queue of finished groups (built with the roles)."""
        if self.data.val is None:
            logger.info("no validation data (data.val_files is unset): this run does not validate")
        self.start(resume)

    def data_costs(self) -> Optional[DataCosts]:
        return DataCosts.read([d for d in (self.data.train, self.data.val) if d is not None])

    def build_roles(self) -> Roles:
        roles = build_roles(self.config, self.optimizer_steps)
        self.forward = Forward.of(self.config, roles.actor_model)  # how log-prob and update passes are laid out
        if self.config.model.path.startswith(RANDOM_PREFIX):  # the engine built its own random weights: the actor's
            roles.sync()
        if self.config.trainer.rollout_mode == "async":
            self.partial = async_rollouts(self.config, roles.rollout, self.data_costs())
            if self.guard is not None:
                self.guard.queue = self.partial.queue
        return roles

    def new_batches(self) -> Iterator[Batch]:
        return self.data.train_batches()

    def restore(self, folder: Optional[Path]) -> None:
        self.ready = None  # a checkpoint that holds a generated next batch brings it back (load_driver_state)
        super().restore(folder)

    def driver_state(self, folder: Path) -> dict[str, Any]:
        state: dict[str, Any] = {"kl": self.kl.state_dict()}
        if self.ready is not None:  # one_step_off: the batch generated for the next step
            state["ahead"] = save_generated(self.ready, folder)
        if self.partial is not None:  # async: the queue, the engines' started batches, the unread one
            state["async"] = self.partial.save(folder, lambda b: self.start_scoring(b)(PhaseTimer()))
        return state

    def abandoned_at(self, boundary: dict[str, Any]) -> dict[str, Any]:
        """async: the prompts read during the abandoned step are in the queue, the engines or the unread batch,
        which the checkpoint holds: the data position stays where reading stopped."""
        if self.partial is None:
            return boundary
        return {**boundary, "data": self.loader.state_dict()}

    def load_driver_state(self, state: dict[str, Any], folder: Path) -> None:
        self.kl.load_state_dict(state["kl"])
        self.ready = load_generated(state["ahead"], folder) if "ahead" in state else None
        self.roles.sync()  # the engine serves the restored weights
        if self.partial is not None and "async" in state:
            self.partial.load(state["async"], folder)
            if self.guard is not None:  # the watchdog relieves the restored queue, not the one it replaced
                self.guard.queue = self.partial.queue

    # ------------------------------------------------------------------ one step

    def train_step(self, prompts: Optional[Iterator[Batch]] = None) -> StepResult:
        prompts = self.batches if prompts is None else prompts
        timer, start = PhaseTimer(), time.perf_counter()
        batch, scoring, sampling = self.rollout(prompts, timer)
        ahead = self.generate_ahead(prompts) if self.one_step_off else None  # the next batch, while this trains
        self.check_pressure("rollout")  # before the update, hard pressure ends the step unfinished: nothing lost
        if self.roles.rollout_sleeps:
            with timer("sleep"):  # the engine hands the device to the training roles until the sync
                self.roles.sleep_engine()
        batch = self.with_reference(batch, timer)  # while the reward workers score the responses
        scores = scoring(timer)
        self.check_pressure("ref")
        with timer("old_log_probs"):
            batch, agreement = self.with_old_log_probs(batch)
        with timer("advantages"):
            batch, shaping = self.add_advantages(batch, scores)
        self.check_pressure("old_log_probs")
        self.note(largest_micro_batches(batch, self.roles.actor.members, self.config, self.forward))
        with timer("update"):
            update = self.update(batch)
        if self.partial is not None:
            self.partial.commit()
        self.check_pressure("update", before_update=False)  # from here on the step finishes and saves
        next_batch = self.finish_ahead(ahead, timer) if ahead is not None else None
        with timer("sync"):  # the engine's weights wake, the actor's go in
            synced = self.roles.sync()
        if next_batch is not None:
            self.ready = next_batch()  # scored while the weights synced
        metrics = {**reward_metrics(scores), **response_metrics(batch, self.config.data.max_response_length),
                   **update, **sampling, **synced, **agreement, **shaping}
        metrics["actor/kl_coef"] = self.kl.coef
        metrics.update(timer.times)
        metrics["time/step"] = time.perf_counter() - start
        if "time/generate" in metrics:  # this step generated its batch (one step off, it trained on one made earlier)
            tokens = float(batch["response_mask"].sum())
            metrics["perf/generate_tokens_per_s"] = tokens / max(metrics["time/generate"], 1e-9)
        # tokens the update's forward and backward passes ran over (prompt and response, every PPO epoch): its MFU
        metrics["perf/update_tokens"] = float(batch["attention_mask"].sum()) * self.config.worker.actor.ppo_epochs
        memory, readings = self.memory()
        metrics.update(memory)
        return StepResult(metrics, timer.spans, readings)

    # ------------------------------------------------------------------ phases

    def rollout(self, prompts: Iterator[Batch], timer: PhaseTimer) -> tuple[Batch, Scoring, dict[str, float]]:
        """Generate, and send the responses to be scored: the scores are collected after the reference pass,
        which runs meanwhile (:data:`Scoring`). With dynamic sampling, keep groups with signal and refill (DAPO):
        that needs the scores first. One step off: the batch generated during the last step (the first step
        generates its own) and its staleness."""
        if self.partial is not None:
            batch, scores, metrics = self.partial.next_batch(prompts, self.step, self.step - 1,
                                                             lambda b: self.start_scoring(b)(timer), timer)
            self.metrics.log_order(self.step, list(batch.meta["uids"]))
            return batch, lambda _: scores, metrics
        if self.one_step_off:
            ready = self.ready or Generated(*self.generate_and_score(next(prompts), timer), version=self.step - 1)
            self.metrics.log_order(self.step, list(ready.batch.meta["uids"]))
            return ready.batch, lambda _: ready.scores, {"rollout/staleness": float(self.step - 1 - ready.version)}
        first = next(prompts)
        uids = list(first.meta["uids"])
        if not self.config.algorithm.dynamic_sampling:
            batch = self.generate(first, timer)
            self.metrics.log_order(self.step, uids)
            return batch, self.start_scoring(batch), {}
        batch, scores = self.generate_and_score(first, timer)
        n, target = self.config.worker.rollout.n, self.config.data.rollout_batch_size
        rounds = [(batch, scores)]
        while (informative_count(rounds, n) < target
               and len(rounds) <= self.config.algorithm.max_sampling_retries):
            more = next(prompts)
            uids += list(more.meta["uids"])
            rounds.append(self.generate_and_score(more, timer, call=len(rounds)))
        self.metrics.log_order(self.step, uids)
        batch, scores = keep_informative(rounds, n, target)
        return batch, lambda _: scores, {"sampling/rounds": float(len(rounds)),
                               "sampling/informative_groups": float(min(informative_count(rounds, n), target))}

    def generate(self, prompts: Batch, timer: PhaseTimer, validate: bool = False, call: int = 0) -> Batch:
        with timer("generate"):
            self.roles.wake_engine(generate=True)  # and its KV cache
            batch = self.roles.rollout.call("generate", prompts, self.step, validate, call)
        return batch if validate else with_prompt_visuals(batch, prompts, self.config.worker.rollout.n)

    def generate_and_score(self, prompts: Batch, timer: PhaseTimer, validate: bool = False,
                           call: int = 0) -> tuple[Batch, dict[str, torch.Tensor]]:
        batch = self.generate(prompts, timer, validate, call)
        return batch, self.start_scoring(batch)(timer, validate)

    def start_scoring(self, batch: Batch) -> Scoring:
        """Send ``batch``'s responses to the reward workers (its texts go in its meta); returns the call that
        waits for their scores (:meth:`collect_scores`), so the driver can do other work until it needs them."""
        texts = self.data.decode(batch)
        batch.meta["texts"] = texts
        pending = self.roles.rewards.submit(texts, batch.meta["answers"])
        return lambda timer, validate=False: self.collect_scores(pending, timer, validate)

    def generate_ahead(self, prompts: Iterator[Batch]) -> tuple[Batch, Pending]:
        """One step off: the engine starts generating the next step's batch, with the weights it holds now."""
        first = next(prompts)
        return first, self.roles.rollout.submit("generate", first, self.step + 1, False, 0)

    def finish_ahead(self, ahead: tuple[Batch, Pending], timer: PhaseTimer) -> Callable[[], Generated]:
        """Wait for the next step's batch (``time/generate_wait``: what the update did not hide) and send it to
        be scored; returns the call that collects the scores (after the weight sync)."""
        prompts, pending = ahead
        with timer("generate_wait"):
            batch = with_prompt_visuals(self.roles.rollout.collect(pending), prompts, self.config.worker.rollout.n)
        scoring = self.start_scoring(batch)
        version = self.step - 1  # the engine held the weights of the last step's sync
        return lambda: Generated(batch, scoring(timer), version)

    def collect_scores(self, pending: Any, timer: PhaseTimer, validate: bool) -> dict[str, torch.Tensor]:
        """The reward table of the scoring :meth:`start_scoring` sent."""
        with timer("reward"):  # a reward function that grows under hard pressure is stopped, with the step
            watch = None if validate else self.watch_phase("reward")
            scores, errors = self.roles.rewards.collect(pending, watch, self.config.watchdog.sample_period_s)
        table = {key: torch.tensor([s.get(key, 0.0) for s in scores]) for key in scores[0]}
        table["errors"] = torch.full((len(scores),), float(errors) / max(1, len(scores)))
        return table

    def with_reference(self, batch: Batch, timer: PhaseTimer) -> Batch:
        """The reference log-probs, when the run has a reference."""
        reference = self.roles.reference
        if reference is None:
            return batch
        with timer("ref"):
            return batch.union(Batch({"ref_log_probs": self.log_probs(reference, "compute_ref_log_probs", batch)}))

    def with_old_log_probs(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The log-probs the update's PPO ratio is taken against: the actor's at its current weights (skipped when
        the update is exactly on-policy and may reuse its own), or one step off the engine's sampling log-probs
        (the behaviour policy), with truncated importance weights against the actor's when algorithm.tis_cap > 0.
        Where the actor's were computed, how far the engine's are from them (``rollout/log_prob_diff_*``)."""
        a, cap = self.config.worker.actor, self.config.algorithm.tis_cap
        if self.behind and cap == 0:
            return batch.union(Batch({"old_log_probs": batch["rollout_log_probs"]})), {}
        if self.on_policy and a.reuse_log_probs_on_policy and not self.behind:
            return batch, {}
        old = self.log_probs(self.roles.actor, "compute_log_probs", batch)
        batch = batch.union(Batch({"old_log_probs": old}))
        if self.behind:
            weights = importance_weights(old, batch["rollout_log_probs"], batch["response_mask"].float(), cap)
            batch = batch.union(Batch({"is_weights": weights}))
        return batch, log_prob_agreement(batch)

    def add_advantages(self, batch: Batch, scores: dict[str, torch.Tensor]) -> tuple[Batch, dict[str, float]]:
        """Per-token advantages of each response's reward (minus the KL when it is in the reward); with the KL in
        the reward, its token mean as ``actor/reward_kl``, which the KL controller steers by."""
        a, n = self.config.algorithm, self.config.worker.rollout.n
        rewards = scores["overall"].to(torch.float32)
        mask = batch["response_mask"]
        metrics: dict[str, float] = {}
        if not a.use_kl_loss and "ref_log_probs" in batch:  # KL in the reward, of the actor's log-probs
            policy = batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]
            rewards, kl = kl_in_reward(rewards, policy, batch["ref_log_probs"], mask, self.kl.coef, a.kl_penalty)
            self.kl.update(kl, len(batch))
            metrics["actor/reward_kl"] = kl
        groups = torch.arange(len(batch)) // n
        advantages = compute_advantages(a.adv_estimator, rewards, groups, a.norm_adv_by_std)
        return batch.union(Batch({"advantages": token_advantages(advantages, mask)})), metrics

    def log_probs(self, group: WorkerGroup, method: str, batch: Batch) -> torch.Tensor:
        """Per-token log-probs from ``group`` (compute_log_probs / compute_ref_log_probs) over the planned micro
        batches, in the order of ``batch``."""
        return run_log_probs(group, method, batch, self.config, self.forward)

    def update(self, batch: Batch) -> dict[str, float]:
        """The actor's PPO update over the planned micro batches; its metrics. With the KL in the loss, the KL
        controller steers by the update's token-mean KL."""
        metrics = reduce_update_metrics(run_update(self.roles.actor, batch, self.config, self.forward, self.kl.coef))
        if "actor/kl_loss" in metrics:
            self.kl.update(metrics["actor/kl_loss"], len(batch))
        return metrics

    def validate(self) -> dict[str, float]:
        if self.data.val is None:  # data.val_files=null: no validation, anywhere (SFT's rule too)
            return {}
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


def with_prompt_visuals(batch: Batch, prompts: Batch, n: int) -> Batch:
    """A generated batch (``n`` responses per prompt) with its prompts' visuals put back, shared with ``prompts``:
    the engine returns none it was sent, so each prompt's pixels do not travel back through the object store and
    sit here twice. A multi-turn batch, whose tool turns may have added images, brings every row's own."""
    if batch.image_counts is not None or prompts.image_counts is None:
        return batch
    return batch.with_visuals_of(prompts.repeat_interleave(n))
