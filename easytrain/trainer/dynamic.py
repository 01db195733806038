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
"""

from __future__ import annotations

import torch

from easytrain.data.packing import Plan, plan_micro_batches
from easytrain.distributed.batch import Batch
from easytrain.distributed.group import WorkerGroup

RESULT_KEYS = {"compute_log_probs": "old_log_probs", "compute_ref_log_probs": "ref_log_probs"}


def token_lengths(batch: Batch) -> list[int]:
    return [int(n) for n in batch["attention_mask"].sum(-1).tolist()]


def shares(batch: Batch, plan: Plan) -> list[list[Batch]]:
    return [[batch.select(micro) for micro in member] for member in plan]


def planned_log_probs(group: WorkerGroup, method: str, batch: Batch, budget: int) -> Batch:
    """``method`` (compute_log_probs / compute_ref_log_probs) over token-budget micro batches, as one Batch in
    the order of ``batch``."""
    plan = plan_micro_batches(token_lengths(batch), group.members, budget)
    results = group.call(f"{method}_planned", shares(batch, plan))
    out = torch.zeros(len(batch), batch["responses"].shape[1])
    for member, values in zip(plan, results):
        for micro, rows in zip(member, values):
            out[micro] = rows
    return Batch({RESULT_KEYS[method]: out})


def update_plan(batch: Batch, per_step: int, members: int, budget: int) -> tuple[list[list[list[Batch]]], list[Plan]]:
    """Each member's micro batches per optimizer step (consecutive ``per_step`` sequences make one step), and
    the plans behind them."""
    plans, steps = [], []
    for start in range(0, len(batch), per_step):
        mini = batch.select(range(start, start + per_step))
        plan = plan_micro_batches(token_lengths(mini), members, budget)
        plans.append(plan)
        steps.append(shares(mini, plan))
    return [[step[m] for step in steps] for m in range(members)], plans
