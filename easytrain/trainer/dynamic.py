"""Padding-free dynamic micro batches for the RL roles (``worker.actor.padding_free``).

Instead of a fixed number of padded sequences per forward, the driver packs
each phase's sequences (prompt plus response tokens, image tokens included)
into micro batches of at most ``worker.actor.max_token_len_per_device``
tokens, balanced over the data-parallel members by tokens with the same
number of micro batches each (:func:`easytrain.data.packing.plan_micro_batches`),
and sends every member its list (``*_planned`` methods, ``Dispatch.EACH``).
A worker runs each micro batch as one flattened sequence, so a short
response next to a long one costs only its own tokens. Results come back per
micro batch and are put back in the batch's order here.

When the workers will run a prompt's samples prompt-once
(``worker.actor.share_prompt``, see :mod:`easytrain.workers.shared_prompt`),
the plan keeps each prompt's samples together and counts the prompt's
tokens once.
"""

from __future__ import annotations

import torch

from easytrain.config.schema import MASKED_ATTENTION, Config
from easytrain.data.packing import Plan, plan_micro_batches
from easytrain.distributed.batch import Batch
from easytrain.distributed.group import WorkerGroup

RESULT_KEYS = {"compute_log_probs": "old_log_probs", "compute_ref_log_probs": "ref_log_probs"}


def token_lengths(batch: Batch) -> list[int]:
    return [int(n) for n in batch["attention_mask"].sum(-1).tolist()]


def shares(batch: Batch, plan: Plan) -> list[list[Batch]]:
    return [[batch.select(micro) for micro in member] for member in plan]


def shares_prompts(config: Config) -> bool:
    """Whether the workers will run each prompt's samples prompt-once."""
    a = config.worker.actor
    return (a.share_prompt and config.model.attn_implementation in MASKED_ATTENTION
            and a.ulysses_size == 1 and config.worker.ref.ulysses_size == 1)


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


def plan(batch: Batch, members: int, budget: int, by_prompt: bool) -> Plan:
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


def run_planned_log_probs(group: WorkerGroup, method: str, batch: Batch, budget: int,
                          by_prompt: bool = False) -> Batch:
    """``method`` (compute_log_probs / compute_ref_log_probs) over token-budget micro batches, as one Batch in
    the order of ``batch``."""
    plan_ = plan(batch, group.members, budget, by_prompt)
    results = group.call(f"{method}_planned", shares(batch, plan_))
    out = torch.zeros(len(batch), batch["responses"].shape[1])
    for member, values in zip(plan_, results):
        for micro, rows in zip(member, values):
            out[micro] = rows
    return Batch({RESULT_KEYS[method]: out})


def update_plan(batch: Batch, per_step: int, members: int, budget: int,
                by_prompt: bool = False) -> tuple[list[list[list[Batch]]], list[Plan]]:
    """Each member's micro batches per optimizer step (consecutive ``per_step`` sequences make one step), and
    the plans behind them."""
    plans, steps = [], []
    for start in range(0, len(batch), per_step):
        mini = batch.select(range(start, start + per_step))
        step_plan = plan(mini, members, budget, by_prompt)
        plans.append(step_plan)
        steps.append(shares(mini, step_plan))
    return [[step[m] for step in steps] for m in range(members)], plans
