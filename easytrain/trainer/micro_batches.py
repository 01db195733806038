"""The micro batches of every log-prob and update call of the RL roles, planned by the driver.

Each worker method runs exactly the micro batches it is sent (``Dispatch.EACH``: a
:class:`~easytrain.distributed.batch.MicroBatches` per data-parallel member, its samples and each prompt's pixels
sent once) the way the plan says; no worker re-cuts a batch or decides a layout of its own.

- Padded (the default): each member gets a contiguous share of the samples (the batch is padded to a
  multiple of the members by repeating leading samples, whose results are dropped), cut into micro batches of
  ``worker.actor.micro_batch_size_per_device_for_experience`` (log-probs) or ``..._for_update`` samples.
- Padding-free (``worker.actor.padding_free``): micro batches of at most
  ``worker.actor.max_token_len_per_device`` tokens, balanced over the members by tokens with the same number
  each (:func:`easytrain.data.packing.plan_micro_batches`); a worker runs each as one flattened sequence.

Whether prompts are shared is decided here, once per micro batch: where the run may share prompts
(:class:`Forward`), samples with the same prompt run it once (:mod:`easytrain.workers.shared_prompt`);
padding-free plans then keep each prompt's samples together and count the prompt's tokens once, padded ones
share only where a row per prompt costs less than the plain rows.

An update's optimizer step s uses samples ``[s * per_step, (s + 1) * per_step)`` whatever the number of
members, so 1 rank and k ranks take the same optimizer steps on the same data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from easytrain.config.schema import Config
from easytrain.data.packing import MicroPlan, plan_micro_batches
from easytrain.distributed.batch import Batch, MicroBatch, MicroBatches
from easytrain.distributed.group import WorkerGroup
from easytrain.memory.rl_shape import shares_prompts
from easytrain.workers.shared_prompt import prompt_groups, rows_pay_off, worth_sharing


@dataclass
class Forward:
    """How the run's log-prob and update passes lay out their micro batches: decided when the roles start, from
    the config, which stays read-only. ``budget`` and ``update_size`` are the one part of a run's settings that
    changes while it runs: the watchdog's relief halves them (:meth:`Relief.halve_micro_batch`), and the
    driver's planning, the plan check and the step's metrics read them here."""

    packed: bool
    """Padding-free micro batches (``worker.actor.padding_free``)."""
    budget: int
    """Tokens per padding-free micro batch (``worker.actor.max_token_len_per_device``)."""
    update_size: int
    """Samples per update micro batch per device when not padding-free
    (``worker.actor.micro_batch_size_per_device_for_update``)."""
    share_prompt: bool
    """Repeated prompts run once: the config allows it (:func:`easytrain.memory.rl_shape.shares_prompts`)
    and the loaded model's attention can (no sliding window)."""
    hidden_size: int = 0
    """The language model's width: what a padded prompt-shared row's cost is weighed with."""

    @classmethod
    def of(cls, config: Config, model: dict[str, Any]) -> "Forward":
        """From the config and the actor's answer to ``setup`` (``shares_prompt``, ``hidden_size``)."""
        a = config.worker.actor
        return cls(a.padding_free, a.max_token_len_per_device, a.micro_batch_size_per_device_for_update,
                   shares_prompts(config) and bool(model.get("shares_prompt", False)),
                   int(model.get("hidden_size", 0)))

    def overrides(self) -> dict[str, int]:
        """The run-time sizes as config keys: the config the planner prices the run's present micro batches on
        (``easytrain.config.with_overrides``)."""
        return {"worker.actor.max_token_len_per_device": self.budget,
                "worker.actor.micro_batch_size_per_device_for_update": self.update_size}

    @property
    def update_micro(self) -> int:
        """The update's micro batch per device: tokens when padding-free, else samples."""
        return self.budget if self.packed else self.update_size


def token_lengths(batch: Batch) -> list[int]:
    return [int(n) for n in batch["attention_mask"].sum(-1).tolist()]


def prompt_units(batch: Batch) -> list[list[int]]:
    """Runs of consecutive samples of one prompt (equal uids)."""
    uids = batch.meta.get("uids") or list(range(len(batch)))
    units: list[list[int]] = []
    for i, uid in enumerate(uids):
        if units and uids[units[-1][0]] == uid:
            units[-1].append(i)
        else:
            units.append([i])
    return units


def packed_indices(batch: Batch, members: int, budget: int, by_prompt: bool) -> MicroPlan:
    """Token-budget micro batches per member; ``by_prompt``: whole prompts, their tokens counted once."""
    if by_prompt:
        units = prompt_units(batch)
        mask = batch["attention_mask"]
        prompt_width = mask.shape[1] - batch["responses"].shape[1]
        prompt, response = mask[:, :prompt_width].sum(-1), mask[:, prompt_width:].sum(-1)
        lengths = [int(prompt[u[0]] + response[u].sum()) for u in units]
        if len(units) >= members and max(lengths) <= budget:
            try:
                by_unit = plan_micro_batches(lengths, members, budget)
            except ValueError:  # too few whole prompts to give every member as many micro batches: plan samples
                pass
            else:
                return [[[i for u in micro for i in units[u]] for micro in member] for member in by_unit]
    return plan_micro_batches(token_lengths(batch), members, budget)


def padded_indices(count: int, members: int, micro_size: int) -> MicroPlan:
    """Contiguous shares per member cut into micro batches of ``micro_size``; ``count`` is padded to a multiple
    of ``members`` by indices ``>= count`` (their samples repeat the leading ones, their results are dropped),
    so every member runs as many micro batches (FSDP's collectives need that)."""
    padded = count + (-count) % members
    share = padded // members
    return [[list(range(start, min(start + micro_size, end))) for start in range(begin, end, micro_size)]
            for begin, end in ((m * share, (m + 1) * share) for m in range(members))]


def plan_indices(batch: Batch, members: int, micro_size: int, forward: Forward) -> MicroPlan:
    """Sample indices of each member's micro batches (padded ones may hold indices past the batch)."""
    if forward.packed:
        return packed_indices(batch, members, forward.budget, forward.share_prompt)
    return padded_indices(len(batch), members, micro_size)


def micro_batch(batch: Batch, indices: list[int], forward: Forward) -> MicroBatch:
    """The samples at ``indices`` (past the end: the leading ones again) as one planned micro batch, prompts
    shared where the run shares them and it pays off."""
    samples = batch.select([i % len(batch) for i in indices])
    groups = None
    if forward.share_prompt:
        found = prompt_groups(samples)
        if worth_sharing(found) and (forward.packed or rows_pay_off(samples, found, forward.hidden_size)):
            groups = found
    return MicroBatch(samples, forward.packed, groups)


def member_micro_batches(batch: Batch, member: list[list[int]], forward: Forward) -> MicroBatches:
    """One member's planned micro batches (sample indices of ``batch``; past the end: the leading ones again) as
    its call sends them: their samples once, each prompt's pixels once (:class:`MicroBatches`)."""
    samples = batch.select([i % len(batch) for micro in member for i in micro])
    bounds = [0]
    for micro in member:
        bounds.append(bounds[-1] + len(micro))
    cut = MicroBatches(samples, bounds, forward.packed)
    if forward.share_prompt:
        cut.prompt_groups = [micro_batch(samples, list(range(bounds[k], bounds[k + 1])), forward).prompt_groups
                             for k in range(len(member))]
    return cut


def micro_batches(batch: Batch, plan: MicroPlan, forward: Forward) -> list[MicroBatches]:
    return [member_micro_batches(batch, member, forward) for member in plan]


def log_prob_shares(batch: Batch, members: int, config: Config,
                    forward: Forward) -> tuple[MicroPlan, list[MicroBatches]]:
    """The plan of a log-prob pass over ``batch`` and each member's micro batches."""
    plan = plan_indices(batch, members, config.worker.actor.micro_batch_size_per_device_for_experience, forward)
    return plan, micro_batches(batch, plan, forward)


def in_batch_order(batch: Batch, plan: MicroPlan, results: list[list[torch.Tensor]]) -> torch.Tensor:
    """The members' per-micro-batch results put back in the order of ``batch`` (padding rows dropped)."""
    out = torch.zeros(len(batch), batch["responses"].shape[1])
    for member, values in zip(plan, results):
        for micro, rows in zip(member, values):
            real = [k for k, i in enumerate(micro) if i < len(batch)]
            out[[micro[k] for k in real]] = rows[real]
    return out


def update_shares(batch: Batch, per_step: int, members: int,
                  forward: Forward) -> tuple[list[list[MicroBatches]], list[MicroPlan]]:
    """Each member's micro batches per optimizer step (consecutive ``per_step`` samples make one step), and
    the plans behind them (indices within the step), at the run's present micro batch (``forward``)."""
    plans, steps = [], []
    for start in range(0, len(batch), per_step):
        whole = start == 0 and per_step == len(batch)  # one optimizer step: no copy of the batch to cut from
        mini = batch if whole else batch.select(range(start, start + per_step))
        step_plan = plan_indices(mini, members, forward.update_size, forward)
        if any(i >= per_step for member in step_plan for micro in member for i in micro):
            raise ValueError(f"{per_step} samples per optimizer step do not split evenly over {members} "
                             f"data-parallel members; use a worker.actor.global_batch_size that does")
        plans.append(step_plan)
        steps.append(micro_batches(mini, step_plan, forward))
    return [[step[m] for step in steps] for m in range(members)], plans


def run_log_probs(group: WorkerGroup, method: str, batch: Batch, config: Config, forward: Forward) -> torch.Tensor:
    """``group``'s ``method`` (compute_log_probs / compute_ref_log_probs) over the planned micro batches of
    ``batch``: per-token log-probs in the order of ``batch``."""
    plan, shares = log_prob_shares(batch, group.members, config, forward)
    return in_batch_order(batch, plan, group.call(method, shares))


def run_update(group: WorkerGroup, batch: Batch, config: Config, forward: Forward,
               kl_coef: float) -> list[dict[str, float]]:
    """The actor group's PPO update over the planned micro batches of ``batch``: each member's summed metrics."""
    per_step = config.worker.actor.global_batch_size * config.worker.rollout.n
    steps, _ = update_shares(batch, per_step, group.members, forward)
    return group.call("update", steps, kl_coef)


def largest_micro_batches(batch: Batch, members: int, config: Config, forward: Forward) -> dict[str, Any]:
    """The step's largest micro batch (most tokens) of the log-prob passes and of the update, as planned for
    ``members`` data-parallel members: its samples, tokens, images and its longest row by uid (``memory.jsonl``
    records it beside the phase peaks, to trace a plan miss to the rows that caused it)."""
    lengths = token_lengths(batch)
    uids = batch.meta.get("uids") or [str(i) for i in range(len(batch))]
    images = batch.image_counts.tolist() if batch.image_counts is not None else None
    light = Batch({k: batch[k] for k in ("attention_mask", "responses")}, {"uids": uids})  # no pixels copied

    def largest(micros: list[list[int]]) -> dict[str, Any]:
        top = max(micros, key=lambda m: sum(lengths[i] for i in m))
        longest = max(top, key=lambda i: lengths[i])
        out = {"samples": len(top), "tokens": sum(lengths[i] for i in top), "longest_row": uids[longest],
               "longest_tokens": lengths[longest]}
        return {**out, "images": sum(images[i] for i in top)} if images is not None else out

    a, n = config.worker.actor, len(batch)
    log_probs = plan_indices(light, members, a.micro_batch_size_per_device_for_experience, forward)
    per_step = a.global_batch_size * config.worker.rollout.n
    update = [[(start + i) % n for i in micro]
              for start in range(0, n, per_step)
              for member in plan_indices(light.select(range(start, min(n, start + per_step))), members,
                                         forward.update_size, forward)
              for micro in member]
    return {"kind": "micro_batches", "log_probs": largest([[i % n for i in micro] for member in log_probs
                                                           for micro in member]),
            "update": largest(update)}
