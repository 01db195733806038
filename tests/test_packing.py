"""Micro-batch plans: packed plans keep their constraints over many length mixes; the padded layout; costs."""

from __future__ import annotations

import math
import random

import pytest

from easytrain.data.packing import plan_micro_batches, plan_stats
from easytrain.trainer.micro_batches import padded_indices


def multimodal_mix(rng: random.Random, count: int, cap: int = 4096) -> list[int]:
    """Chat text (log-normal, median 300) plus 0-4 images of 4..1280 tokens, capped at ``cap``."""
    lengths = []
    for _ in range(count):
        text = int(rng.lognormvariate(math.log(300), 1.0))
        images = sum(rng.randint(4, 1280) for _ in range(rng.choice([0, 0, 1, 1, 1, 2, 3, 4])))
        lengths.append(max(1, min(cap, text + images)))
    return lengths


def random_mix(rng: random.Random, count: int, budget: int) -> list[int]:
    """One of several shapes of length mix, every sample within ``budget``."""
    kind = rng.choice(["uniform", "equal", "bimodal", "tiny", "near_budget", "multimodal", "zeros"])
    if kind == "uniform":
        return [rng.randint(1, budget) for _ in range(count)]
    if kind == "equal":
        return [rng.randint(1, budget)] * count
    if kind == "bimodal":
        return [rng.choice([rng.randint(1, budget // 10 + 1), rng.randint(budget // 2, budget)]) for _ in range(count)]
    if kind == "tiny":
        return [rng.randint(1, 8) for _ in range(count)]
    if kind == "near_budget":
        return [rng.randint(budget - budget // 8, budget) for _ in range(count)]
    if kind == "zeros":
        return [rng.choice([0, rng.randint(1, budget)]) for _ in range(count)]
    return multimodal_mix(rng, count, cap=budget)


def check_plan(lengths: list[int], ranks: int, budget: int, plan: list[list[list[int]]]) -> None:
    assert len(plan) == ranks
    k = len(plan[0])
    assert k >= 1
    assert all(len(rank) == k for rank in plan), [len(rank) for rank in plan]
    for rank in plan:
        for micro in rank:
            assert micro, "empty micro batch"
            assert sum(lengths[i] for i in micro) <= budget
    flat = sorted(i for rank in plan for micro in rank for i in micro)
    assert flat == list(range(len(lengths)))


def fewest_micro_batches(lengths: list[int], ranks: int, budget: int) -> int | None:
    """The smallest equal micro-batch count per rank any plan achieves, by trying every partition (small inputs)."""
    counts: set[int] = set()

    def place(i: int, loads: list[int]) -> None:
        if i == len(lengths):
            counts.add(len(loads))
            return
        for b in range(len(loads)):
            if loads[b] + lengths[i] <= budget:
                loads[b] += lengths[i]
                place(i + 1, loads)
                loads[b] -= lengths[i]
        loads.append(lengths[i])
        place(i + 1, loads)
        loads.pop()

    place(0, [])
    return min((c // ranks for c in counts if c % ranks == 0), default=None)


def test_packed_plans_keep_their_constraints_over_many_mixes() -> None:
    """Equal micro-batch count per rank, budget, every index once, deterministic; refused only when no plan can
    give every rank the same count."""
    planned = 0
    for seed in range(400):
        rng = random.Random(seed)
        ranks = rng.choice([1, 2, 3, 4, 8])
        budget = rng.choice([16, 100, 4096, 8192])
        count = rng.randint(ranks, 12 * ranks)
        lengths = random_mix(rng, count, budget)
        try:
            plan = plan_micro_batches(lengths, ranks, budget)
        except ValueError as error:
            assert "cannot fill" in str(error)
            # bins needed by tokens alone, or by samples over half the budget (two cannot share a bin)
            bins = max(math.ceil(sum(lengths) / budget), sum(2 * n > budget for n in lengths))
            assert count < ranks * math.ceil(bins / ranks), (seed, lengths)
            continue
        planned += 1
        check_plan(lengths, ranks, budget, plan)
        assert plan == plan_micro_batches(list(lengths), ranks, budget)
    assert planned > 300


def test_packed_plans_need_at_most_one_micro_batch_more_than_the_best() -> None:
    """Against exhaustive search on small batches: refused exactly when no plan exists, k optimal or one over."""
    over = 0
    for seed in range(1000):
        rng = random.Random(seed)
        ranks = rng.choice([1, 2, 3, 4])
        budget = rng.choice([16, 100, 4096])
        lengths = random_mix(rng, rng.randint(ranks, 8), budget)
        best = fewest_micro_batches(lengths, ranks, budget)
        if best is None:
            with pytest.raises(ValueError, match="cannot fill"):
                plan_micro_batches(lengths, ranks, budget)
            continue
        plan = plan_micro_batches(lengths, ranks, budget)
        check_plan(lengths, ranks, budget, plan)
        assert best <= len(plan[0]) <= best + 1, (seed, lengths, ranks, budget)
        over += len(plan[0]) > best
    assert over < 10


def test_ranks_are_balanced_by_tokens_on_realistic_mixes() -> None:
    for ranks, count, budget in [(8, 64, 4096), (8, 64, 16384), (4, 64, 8192), (2, 16, 4096), (8, 32, 8192)]:
        imbalances = []
        for seed in range(30):
            lengths = multimodal_mix(random.Random(seed), count)
            plan = plan_micro_batches(lengths, ranks, budget)
            check_plan(lengths, ranks, budget, plan)
            stats = plan_stats(lengths, plan, padded=False)
            assert stats.padding_waste == 0.0
            imbalances.append(stats.rank_imbalance)
        assert max(imbalances) < 1.1, (ranks, count, budget, max(imbalances))
        assert sum(imbalances) / len(imbalances) < 1.03


def test_micro_batches_are_ordered_largest_first_within_a_rank() -> None:
    lengths = multimodal_mix(random.Random(7), 64)
    for rank in plan_micro_batches(lengths, 8, 4096):
        loads = [sum(lengths[i] for i in micro) for micro in rank]
        assert loads == sorted(loads, reverse=True)


def test_a_rank_short_of_samples_borrows_one() -> None:
    # longest first: 10 -> rank 0; 5, 3, 3 -> rank 1, which needs two bins of 10 while rank 0 has one sample
    lengths = [3, 3, 10, 5]
    plan = plan_micro_batches(lengths, 2, 10)
    check_plan(lengths, 2, 10, plan)
    assert len(plan[0]) == 2


def test_rank_with_fewer_bins_splits_its_fullest() -> None:
    # rank 1 packs 4 + 4 + 2 into one bin; rank 0 needs two, so rank 1 splits
    lengths = [8, 4, 4, 3, 2]
    plan = plan_micro_batches(lengths, 2, 10)
    check_plan(lengths, 2, 10, plan)
    assert [len(rank) for rank in plan] == [2, 2]


def test_one_rank_takes_everything_it_can_pack() -> None:
    lengths = [5, 1, 4, 3, 2]
    assert plan_micro_batches(lengths, 1, 100) == [[[0, 2, 3, 4, 1]]]
    assert plan_micro_batches(lengths, 1, 5) == [[[0], [2, 1], [3, 4]]]


def test_over_budget_sample_is_refused() -> None:
    with pytest.raises(ValueError, match=r"sample 2 has 5000 tokens.*budget of 4096"):
        plan_micro_batches([10, 20, 5000, 30], 2, 4096)


def test_too_few_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="3 samples cannot give each of 4"):
        plan_micro_batches([1, 2, 3], 4, 100)
    # 41 tokens need 5 micro batches of 10, so 3 on each of 2 ranks: 6 samples at least
    with pytest.raises(ValueError, match=r"5 samples cannot fill 3 micro batches on each of 2 ranks"):
        plan_micro_batches([10, 10, 10, 10, 1], 2, 10)
    with pytest.raises(ValueError, match="ranks must be at least 1"):
        plan_micro_batches([1], 0, 10)
    with pytest.raises(ValueError, match="negative"):
        plan_micro_batches([1, -1], 1, 10)


def test_fixed_layout_is_contiguous_shares_in_micro_batches() -> None:
    assert padded_indices(8, 2, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert padded_indices(10, 2, 2) == [[[0, 1], [2, 3], [4]], [[5, 6], [7, 8], [9]]]
    assert padded_indices(6, 3, 4) == [[[0, 1]], [[2, 3]], [[4, 5]]]
    plan = padded_indices(64, 8, 4)
    check_plan(list(range(64)), 8, 10**9, plan)
    assert [len(rank) for rank in plan] == [2] * 8
    # 10 over 4 members: padded to 12 by indices past the batch (repeats, their results dropped), 3 each
    assert padded_indices(10, 4, 2) == [[[0, 1], [2]], [[3, 4], [5]], [[6, 7], [8]], [[9, 10], [11]]]


def test_stats_on_a_hand_computed_plan() -> None:
    lengths = [4, 1, 3, 2, 6, 6]
    plan = [[[0, 1], [2]], [[3, 4], [5]]]
    padded = plan_stats(lengths, plan, padded=True)
    # micro batches cost 2x4=8, 1x3=3 | 2x6=12, 1x6=6
    assert padded.tokens == 22
    assert padded.processed_tokens == 29
    assert padded.padded_tokens == 7
    assert padded.padding_waste == pytest.approx(7 / 29)
    assert padded.rank_tokens == [11, 18]
    assert padded.rank_imbalance == pytest.approx(18 / 14.5)
    assert padded.micro_batches_per_rank == [2, 2]
    assert padded.step_tokens == 12 + 6
    assert padded.sync_efficiency == pytest.approx(29 / (2 * 18))
    assert padded.largest_micro_batch == 12
    packed = plan_stats(lengths, plan, padded=False)
    # 5, 3 | 8, 6
    assert packed.processed_tokens == packed.tokens == 22
    assert packed.padded_tokens == 0 and packed.padding_waste == 0.0
    assert packed.rank_tokens == [8, 14]
    assert packed.step_tokens == 8 + 6
    assert packed.largest_micro_batch == 8


def test_stats_with_uneven_micro_batch_counts() -> None:
    stats = plan_stats([5, 5, 5], [[[0], [1]], [[2]]], padded=False)
    assert stats.micro_batches_per_rank == [2, 1]
    assert stats.step_tokens == 10
