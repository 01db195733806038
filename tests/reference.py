"""The published formulas of the RL step, written once for the tests, sharing no code with easytrain's own.

Tests compare the trainer's real paths against these: the learning-rate schedule, GRPO's group advantages,
the KL estimators (Schulman, "Approximating KL divergence"), PPO's clipped surrogate with clip-higher and
dual clip, and the two loss aggregation modes.
"""

from __future__ import annotations

import math

import torch

GRPO_EPS = 1e-6
"""GRPO's guard on the group std."""


def lr_at(k: int, kind: str, warmup: int, total: int, lr: float) -> float:
    """The rate of 0-based optimizer step ``k``: linear warm-up over ``warmup`` steps, then constant, linear or
    cosine decay to zero at ``total``."""
    if k < warmup:
        return lr * (k + 1) / warmup
    if kind == "constant":
        return lr
    progress = (k - warmup) / (total - warmup)
    return lr * (1 - progress) if kind == "linear" else lr * 0.5 * (1 + math.cos(math.pi * progress))


def grpo_advantages(rewards: torch.Tensor, n: int, by_std: bool = True) -> torch.Tensor:
    """Consecutive groups of ``n``: reward minus the group mean, over the unbiased group std (+ eps) unless
    ``by_std`` is off (Dr. GRPO)."""
    groups = rewards.view(-1, n)
    centred = groups - groups.mean(-1, keepdim=True)
    return (centred / (groups.std(-1, keepdim=True) + GRPO_EPS) if by_std else centred).flatten()


def kl_estimate(log_probs: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """k1 = log p - log q; k3 (``low_var_kl``) = q/p - log(q/p) - 1."""
    if kind == "kl":
        return log_probs - ref
    log_q_over_p = ref - log_probs
    return torch.exp(log_q_over_p) - log_q_over_p - 1


def ppo_token_loss(log_probs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                   clip_high: float, clip_dual: float) -> torch.Tensor:
    """max(-A r, -A clip(r, 1 - low, 1 + high)), and for A < 0 at most -A c (dual clip)."""
    ratio = torch.exp(log_probs - old)
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
    return torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_dual), loss)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """token-mean: over every response token; seq-mean-token-mean: each sequence's token mean, averaged."""
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return ((values * mask).sum(-1) / mask.sum(-1)).mean()
    raise ValueError(mode)
