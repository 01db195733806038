"""KL estimators between the policy and the reference, and the adaptive coefficient."""

from __future__ import annotations

import torch

KL_CLAMP = 10.0


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs.

    kl (k1): log p - log q; abs: |log p - log q|; mse (k2): (log p - log q)^2 / 2;
    low_var_kl (k3): q/p - log(q/p) - 1, non-negative and low variance, clamped for stability.
    """
    diff = log_probs - ref_log_probs
    if kind == "kl":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "mse":
        return 0.5 * diff.square()
    if kind == "low_var_kl":
        log_ratio = (-diff).clamp(-KL_CLAMP, KL_CLAMP)
        return (log_ratio.exp() - log_ratio - 1).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(f"unknown kl_penalty {kind!r}")


def kl_in_reward(rewards: torch.Tensor, log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                 response_mask: torch.Tensor, coef: float, kind: str) -> tuple[torch.Tensor, float]:
    """KL in the reward: each response's reward minus ``coef`` times its summed per-token KL estimate; and the
    token mean of that estimate over the batch's response tokens (what an adaptive coefficient steers)."""
    kl = kl_penalty(log_probs, ref_log_probs, kind) * response_mask
    return rewards - coef * kl.sum(-1), float(kl.sum() / response_mask.sum().clamp(min=1))


class KLController:
    """Fixed coefficient, or adaptive toward a target KL (proportional control, error clipped to +-20%)."""

    def __init__(self, coef: float, adaptive: bool = False, target: float = 0.1, horizon: int = 10000) -> None:
        self.coef, self.adaptive, self.target, self.horizon = coef, adaptive, target, horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        if not self.adaptive:
            return
        error = max(-0.2, min(0.2, current_kl / self.target - 1.0))
        self.coef *= 1.0 + error * n_samples / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])
