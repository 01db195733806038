"""Advantage estimators: pure functions of rewards (and masks), no Ray, no models.

Rewards are one scalar per response; ``groups`` gives each response the index
of its prompt (the n responses of a prompt share it). Every estimator
returns one advantage per response; :func:`token_advantages` spreads them
over the response tokens.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def _group_stats(rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response group mean, unbiased group std and group size."""
    _, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    means = sums / counts
    squares = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    stds = torch.sqrt(squares / (counts - 1).clamp(min=1))
    return means[inverse], stds[inverse], counts[inverse].to(rewards.dtype)


def grpo(rewards: torch.Tensor, groups: torch.Tensor, norm_by_std: bool = True) -> torch.Tensor:
    """GRPO: reward minus its group's mean, divided by the group's std unless ``norm_by_std`` is off (Dr. GRPO)."""
    mean, std, _ = _group_stats(rewards, groups)
    centred = rewards - mean
    return centred / (std + EPS) if norm_by_std else centred


def rloo(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """RLOO: reward minus the mean of the *other* responses of its prompt."""
    mean, _, count = _group_stats(rewards, groups)
    return (rewards - mean) * count / (count - 1).clamp(min=1)


def reinforce_plus_plus(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a baseline: subtract the group mean, then whiten over the whole batch."""
    centred = rewards - _group_stats(rewards, groups)[0]
    return (centred - centred.mean()) / (centred.std() + EPS) if len(centred) > 1 else centred


ESTIMATORS = {"grpo": grpo, "rloo": rloo, "reinforce_plus_plus": reinforce_plus_plus}


def compute_advantages(name: str, rewards: torch.Tensor, groups: torch.Tensor, norm_by_std: bool = True) -> torch.Tensor:
    if name == "grpo":
        return grpo(rewards, groups, norm_by_std)
    return ESTIMATORS[name](rewards, groups)


def token_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome advantages on every response token (zero on padding)."""
    return advantages[:, None].to(torch.float32) * response_mask


def informative_groups(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: a mask of responses whose group's rewards are not all equal.

    A group where every response scored the same gives zero advantage to all
    of them and only dilutes the batch.
    """
    _, std, _ = _group_stats(rewards, groups)
    return std > EPS
