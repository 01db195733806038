"""Micro-batch plans for SFT: padding-free packs balanced over data-parallel ranks, or fixed-size shares.

The driver holds one global batch whose samples have known token lengths
(text plus image tokens). Each data-parallel rank receives a list of micro
batches, lists of sample indices into the batch. A packed micro batch is
flattened into one sequence without padding, so its cost is the sum of its
lengths and it must fit ``worker.actor.max_token_len_per_device``.

Every rank must run the same number of forward/backward passes: FSDP and
DeepSpeed issue collectives per pass, and a rank with one pass fewer would
leave the others waiting in an all-gather forever. ``plan_micro_batches``
therefore gives every rank exactly ``k`` non-empty micro batches, with ``k``
as small as the greedy packing finds.

Pure Python, deterministic: the same lengths always give the same plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

MicroPlan = list[list[list[int]]]
"""Per rank, its micro batches; each micro batch a list of sample indices."""


def plan_micro_batches(lengths: Sequence[int], ranks: int, budget: int) -> MicroPlan:
    """Per rank, a list of ``k`` micro batches (sample indices into ``lengths``), each within ``budget`` tokens.

    1. Longest-processing-time first: samples, longest first, go to the rank
       with the fewest tokens so far, which balances compute over ranks.
    2. First-fit decreasing packs each rank's samples into bins of at most
       ``budget`` tokens.
    3. ``k`` is the most bins any rank needs; ranks with fewer split their
       fullest bins (or, when every bin holds a single sample, take one small
       sample from a rank that can spare it) until all have ``k``.

    Within a rank the micro batches are ordered by tokens, largest first, so
    that the i-th micro batches of all ranks, which run in lockstep, are of
    similar size.
    """
    _check_positive(ranks=ranks, budget=budget)
    sizes = [int(n) for n in lengths]
    for i, n in enumerate(sizes):
        if n < 0:
            raise ValueError(f"sample {i} has a negative length ({n})")
        if n > budget:
            raise ValueError(f"sample {i} has {n} tokens, more than the packed micro-batch budget of {budget} "
                             "tokens (worker.actor.max_token_len_per_device); raise the budget or shorten the "
                             "sample (data.max_prompt_length / data.max_response_length, image max_pixels)")
    if len(sizes) < ranks:
        raise ValueError(f"{len(sizes)} samples cannot give each of {ranks} data-parallel ranks a micro batch; "
                         f"use worker.actor.global_batch_size >= {ranks}")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins = [_first_fit_decreasing(share, sizes, budget) for share in _assign_to_ranks(order, sizes, ranks)]
    k = max(len(b) for b in bins)
    if len(sizes) < ranks * k:
        raise ValueError(f"{len(sizes)} samples cannot fill {k} micro batches on each of {ranks} ranks "
                         f"({ranks * k} needed, one sample at least per micro batch; {k} micro batches of at most "
                         f"{budget} tokens are needed on the fullest rank); use a larger worker.actor.global_batch_size, fewer "
                         "ranks, or a larger worker.actor.max_token_len_per_device")
    _equalise_counts(bins, sizes, k)
    return [[sorted(b, key=lambda i: (-sizes[i], i)) for b in sorted(rank, key=lambda b: _order_key(b, sizes))]
            for rank in bins]


@dataclass
class PlanStats:
    """What a plan costs. "Processed" tokens are the positions the model runs forward and backward over:
    for a padded micro batch its sample count times its longest sample, for a packed one the sum of lengths."""

    tokens: int
    """Real tokens of the batch (sum of lengths)."""
    padded_tokens: int
    """Padding positions processed on top of the real tokens."""
    processed_tokens: int
    """tokens + padded_tokens."""
    padding_waste: float
    """padded_tokens / processed_tokens: the share of compute spent on padding."""
    rank_tokens: list[int] = field(default_factory=list)
    """Processed tokens per rank."""
    rank_imbalance: float = 1.0
    """max / mean of rank_tokens (1.0 = perfectly balanced)."""
    micro_batches_per_rank: list[int] = field(default_factory=list)
    """How many micro batches each rank runs (equal in a valid plan)."""
    step_tokens: int = 0
    """Sum over micro-batch index of the most processed tokens any rank has at that index: what ranks that
    synchronise after every micro batch wait for, in tokens."""
    sync_efficiency: float = 1.0
    """processed_tokens / (ranks x step_tokens): the share of rank time doing work rather than waiting."""
    largest_micro_batch: int = 0
    """Most processed tokens in one micro batch: what sets the activation memory peak."""


def plan_stats(lengths: Sequence[int], plan: MicroPlan, padded: bool) -> PlanStats:
    """The cost of ``plan`` over samples of ``lengths``; ``padded`` prices micro batches as padded to their longest
    sample (True) or flattened without padding (False)."""
    def cost(micro: list[int]) -> int:
        if not micro:
            return 0
        return len(micro) * max(lengths[i] for i in micro) if padded else sum(lengths[i] for i in micro)

    costs = [[int(cost(m)) for m in rank] for rank in plan]
    tokens = int(sum(lengths[i] for rank in plan for m in rank for i in m))
    rank_tokens = [sum(c) for c in costs]
    processed = sum(rank_tokens)
    depth = max((len(c) for c in costs), default=0)
    step = sum(max(c[j] if j < len(c) else 0 for c in costs) for j in range(depth))
    mean = processed / len(plan) if plan else 0.0
    return PlanStats(
        tokens=tokens, padded_tokens=processed - tokens, processed_tokens=processed,
        padding_waste=(processed - tokens) / processed if processed else 0.0,
        rank_tokens=rank_tokens, rank_imbalance=max(rank_tokens) / mean if mean else 1.0,
        micro_batches_per_rank=[len(c) for c in costs], step_tokens=step,
        sync_efficiency=processed / (len(plan) * step) if step else 1.0,
        largest_micro_batch=max((x for c in costs for x in c), default=0))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def _order_key(micro: list[int], sizes: list[int]) -> tuple[int, int]:
    return -sum(sizes[i] for i in micro), min(micro)


def _assign_to_ranks(order: list[int], sizes: list[int], ranks: int) -> list[list[int]]:
    """Longest-processing-time first over ``order`` (longest first): each sample to the lightest rank, ties
    to the rank with fewer samples, then the lower rank."""
    heap = [(0, 0, r) for r in range(ranks)]
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in order:
        tokens, count, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (tokens + sizes[i], count + 1, r))
    return shares


def _first_fit_decreasing(share: list[int], sizes: list[int], budget: int) -> list[list[int]]:
    """Bins of at most ``budget`` tokens; ``share`` is already longest first."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in share:
        for b, load in enumerate(loads):
            if load + sizes[i] <= budget:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])
    return bins


def _equalise_counts(bins: list[list[list[int]]], sizes: list[int], k: int) -> None:
    """Bring every rank to exactly ``k`` non-empty bins, in place; needs at least ``k`` samples per rank overall.

    A rank short of bins splits its fullest multi-sample bin in two (halves can only shrink, so the budget
    holds). A rank whose bins are all single samples has fewer than ``k`` samples: it takes the smallest
    sample of the rank with the most samples beyond ``k`` (that rank keeps at least ``k``, so it can split
    back up if it loses a bin). Each step either adds a bin or shrinks the total shortfall of samples, so
    the loop ends.
    """
    def load(b: list[int]) -> int:
        return sum(sizes[i] for i in b)

    while True:
        short = [r for r, rank in enumerate(bins) if len(rank) < k]
        if not short:
            return
        rank = bins[short[0]]
        splittable = [b for b in rank if len(b) > 1]
        if splittable:
            fullest = min(splittable, key=lambda b: (-load(b), min(b)))
            rank.remove(fullest)
            rank.extend(_split(fullest, sizes))
            continue
        donor = max((r for r in range(len(bins)) if sum(len(b) for b in bins[r]) > k),
                    key=lambda r: (sum(len(b) for b in bins[r]), -r))
        source = min((b for b in bins[donor]), key=lambda b: (min(sizes[i] for i in b), min(b)))
        sample = min(source, key=lambda i: (sizes[i], i))
        source.remove(sample)
        if not source:
            bins[donor].remove(source)
        rank.append([sample])


def _split(micro: list[int], sizes: list[int]) -> list[list[int]]:
    """Two non-empty halves of ``micro`` with tokens as equal as greedy gets them."""
    ordered = sorted(micro, key=lambda i: (-sizes[i], i))
    halves: list[list[int]] = [[ordered[0]], [ordered[1]]]
    loads = [sizes[ordered[0]], sizes[ordered[1]]]
    for i in ordered[2:]:
        lighter = 0 if loads[0] <= loads[1] else 1
        halves[lighter].append(i)
        loads[lighter] += sizes[i]
    return halves
