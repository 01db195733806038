"""The clipped policy-gradient loss and masked reductions."""

from __future__ import annotations

from typing import Sequence

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def aggregate(token_losses: torch.Tensor, mask: torch.Tensor, mode: str, normaliser: float) -> torch.Tensor:
    """Reduce per-token losses to the micro batch's share of the mini-batch loss.

    token-mean: sum over tokens / ``normaliser`` (the mini batch's token count,
    over all ranks), so micro batches and ranks add up to one token mean.
    seq-mean-token-mean: each sequence's token mean, summed / ``normaliser``
    (the mini batch's sequence count).
    """
    if mode == "token-mean":
        return masked_sum(token_losses, mask) / normaliser
    if mode == "seq-mean-token-mean":
        per_seq = (token_losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / normaliser
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                clip_low: float, clip_high: float, clip_dual: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO loss with clip-higher (separate low/high bounds) and dual clip for negative advantages.

    Returns the token losses and per-token indicators for metrics (clipped,
    dual-clipped) plus the log ratio.
    """
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = -advantages * clip_dual
    use_dual = (advantages < 0) & (loss > dual)
    loss = torch.where(use_dual, dual, loss)
    return loss, {"clipped": (clipped > unclipped).float(), "dual_clipped": use_dual.float(), "log_ratio": log_ratio}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) (-inf logits contribute nothing)."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p.masked_fill(torch.isinf(log_p), 0.0)).sum(-1)


def sampling_logits(logits: torch.Tensor, temperature: float = 1.0,
                    suppressed: Sequence[int] = ()) -> torch.Tensor:
    """Logits of the sampling distribution: divided by the temperature, never-generated tokens at -inf."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    if suppressed:
        scaled[..., list(suppressed)] = float("-inf")
    return scaled


def gather_log_probs(scaled_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax of already-scaled logits at ``tokens``."""
    return torch.log_softmax(scaled_logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                    suppressed: Sequence[int] = ()) -> torch.Tensor:
    """log-probs of ``tokens`` under the sampling distribution (see :func:`sampling_logits`)."""
    return gather_log_probs(sampling_logits(logits, temperature, suppressed), tokens)
