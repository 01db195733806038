"""Advantage estimators, KL estimators and the policy loss against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from easytrain.algorithms.advantages import compute_advantages, informative_groups, token_advantages
from easytrain.algorithms.kl import KLController, kl_penalty
from easytrain.algorithms.losses import aggregate, policy_loss, token_log_probs

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def close(actual: torch.Tensor, expected: list[float]) -> None:
    assert torch.allclose(actual, torch.tensor(expected, dtype=torch.float32), atol=1e-4), actual


def test_grpo_by_hand() -> None:
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: mean 0.75, std 0.5
    s = 0.5 / math.sqrt(1 / 3)
    close(compute_advantages("grpo", REWARDS, GROUPS), [s, -s, -s, s, 0.5, 0.5, 0.5, -1.5])


def test_grpo_without_std_by_hand() -> None:
    close(compute_advantages("grpo", REWARDS, GROUPS, norm_by_std=False),
          [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])


def test_rloo_by_hand() -> None:
    # reward minus the mean of the other three: 1 - 1/3, 0 - 2/3; 1 - 2/3, 0 - 1
    close(compute_advantages("rloo", REWARDS, GROUPS),
          [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0])


def test_reinforce_plus_plus_by_hand() -> None:
    # centred [.5,-.5,-.5,.5,.25,.25,.25,-.75]: batch mean 0, unbiased std 0.5
    close(compute_advantages("reinforce_plus_plus", REWARDS, GROUPS), [1, -1, -1, 1, 0.5, 0.5, 0.5, -1.5])


def test_groups_need_not_be_contiguous() -> None:
    order = torch.tensor([4, 0, 5, 1, 6, 2, 7, 3])
    shuffled = compute_advantages("grpo", REWARDS[order], GROUPS[order])
    assert torch.allclose(shuffled, compute_advantages("grpo", REWARDS, GROUPS)[order])


def test_dynamic_sampling_keeps_groups_with_signal() -> None:
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1])).tolist() == [False] * 4
    assert informative_groups(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])).tolist() == [
        True, True, False, False]


def test_token_advantages_respect_the_mask() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    close(token_advantages(torch.tensor([2.0, -1.0]), mask).flatten(), [2, 2, 0, -1, 0, 0])


@pytest.mark.parametrize("kind,expected", [("kl", 1.0), ("abs", 1.0), ("mse", 0.5),
                                           ("low_var_kl", math.exp(-1) + 1 - 1)])
def test_kl_estimators_by_hand(kind: str, expected: float) -> None:
    assert kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), kind).item() == pytest.approx(expected, abs=1e-6)


def test_low_var_kl_is_zero_on_policy_and_non_negative() -> None:
    logp = torch.randn(100)
    assert torch.allclose(kl_penalty(logp, logp, "low_var_kl"), torch.zeros(100))
    assert (kl_penalty(logp, torch.randn(100), "low_var_kl") >= 0).all()


def test_adaptive_kl_moves_toward_target() -> None:
    fixed = KLController(0.1)
    fixed.update(1.0, 100)
    assert fixed.coef == 0.1
    adaptive = KLController(0.1, adaptive=True, target=0.1, horizon=1000)
    adaptive.update(0.5, 100)  # KL too high: error clipped to +20%, scaled by 100/1000
    assert adaptive.coef == pytest.approx(0.1 * 1.02)
    adaptive.update(0.0, 100)
    assert adaptive.coef == pytest.approx(0.1 * 1.02 * 0.98)


def test_policy_loss_clip_higher_and_dual_clip_by_hand() -> None:
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 1.5, 4.0, 0.5]))
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    loss, info = policy_loss(new, old, adv, clip_low=0.2, clip_high=0.28, clip_dual=3.0)
    # +adv, ratio 1.5: clipped at 1.28; -adv, 1.5: unclipped 1.5; -adv, 4.0: dual clip at 3; +adv, 0.5: 0.5 (min side)
    close(loss, [-1.28, 1.5, 3.0, -0.5])
    close(info["clipped"], [1, 0, 0, 0])
    close(info["dual_clipped"], [0, 0, 1, 0])


def test_token_mean_adds_up_over_micro_batches() -> None:
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    whole = aggregate(losses, mask, "token-mean", normaliser=5)
    parts = aggregate(losses[:1], mask[:1], "token-mean", 5) + aggregate(losses[1:], mask[1:], "token-mean", 5)
    assert whole.item() == pytest.approx(18 / 5) and parts.item() == pytest.approx(whole.item())
    seq = aggregate(losses, mask, "seq-mean-token-mean", normaliser=2)
    assert seq.item() == pytest.approx((1.5 + 5.0) / 2)


def test_log_probs_use_the_sampling_temperature() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    got = token_log_probs(logits, torch.tensor([[0]]), temperature=0.5)
    assert got.item() == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, 0, 0].item())


def test_dynamic_sampling_keeps_informative_groups_first_then_fills() -> None:
    from easytrain.distributed.batch import Batch
    from easytrain.trainer.sampling import informative_count, keep_informative

    def round_(uids: list[str], rewards: list[float]) -> tuple[Batch, dict[str, torch.Tensor]]:
        return Batch({"r": torch.tensor(rewards)}, {"uids": uids}), {"overall": torch.tensor(rewards)}

    # n = 2; round 1: groups a (signal), b (none); round 2: c (none), d (signal)
    first = round_(["a", "a", "b", "b"], [1.0, 0.0, 1.0, 1.0])
    second = round_(["c", "c", "d", "d"], [0.0, 0.0, 0.0, 1.0])
    assert informative_count([first], 2) == 1 and informative_count([first, second], 2) == 2
    batch, scores = keep_informative([first, second], n=2, target=2)
    assert batch.meta["uids"] == ["a", "a", "d", "d"] and scores["overall"].tolist() == [1.0, 0.0, 0.0, 1.0]
    batch, _ = keep_informative([first, second], n=2, target=3)  # retries ran out: fill with a flat group
    assert batch.meta["uids"] == ["a", "a", "d", "d", "b", "b"]
