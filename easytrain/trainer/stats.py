"""Per-step metrics from rewards, responses and the actor's update sums."""

from __future__ import annotations

from typing import Any

import torch

from easytrain.distributed.batch import Batch


def reward_metrics(scores: dict[str, torch.Tensor]) -> dict[str, float]:
    overall = scores["overall"]
    out = {"reward/mean": float(overall.mean()), "reward/std": float(overall.std()) if len(overall) > 1 else 0.0,
           "reward/max": float(overall.max()), "reward/min": float(overall.min())}
    for key, values in scores.items():
        if key not in ("overall", "errors"):
            out[f"reward/{key}"] = float(values.mean())
    if "errors" in scores:
        out["reward/error_rate"] = float(scores["errors"].mean())
    return out


def response_metrics(batch: Batch, max_length: int) -> dict[str, float]:
    """Response lengths (the model's tokens); clip_ratio is the share cut off at data.max_response_length (tool
    turns count towards it). Multi-turn rollouts add their tool calls and failed calls."""
    lengths = batch["response_mask"].sum(-1)
    held = batch.tensors.get("response_attention_mask", batch["response_mask"]).sum(-1)
    width = batch["responses"].shape[1]
    out = {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
           "response_length/min": float(lengths.min()),
           "response_length/clip_ratio": float((held >= max_length).float().mean()),
           "prompt_length/mean": float(batch["attention_mask"][:, : -width].sum(-1).float().mean())}
    if "tool_calls" in batch:
        out["rollout/tool_calls"] = float(batch["tool_calls"].mean())
        out["rollout/tool_errors"] = float(batch["tool_errors"].sum())
    return out


def reduce_update_metrics(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """Sum the ranks' token-weighted sums and divide by tokens (grad norm: by optimizer steps)."""
    total: dict[str, float] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            total[key] = total.get(key, 0.0) + float(value)
    tokens = max(total.pop("actor/tokens", 1.0), 1.0)
    steps = max(total.pop("actor/optimizer_steps", 1.0), 1.0)
    out = {"actor/lr": float(per_rank[0].get("actor/lr", 0.0))}
    total.pop("actor/lr", None)
    for key, value in total.items():
        name = key[: -len("_sum")] if key.endswith("_sum") else key
        out[name] = value / steps if name == "actor/grad_norm" else value / tokens
    return out


def log_prob_agreement(batch: Batch) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the actor's recomputed old log-probs, over response
    tokens: near zero when the rollout ran the actor's current weights (a missed weight sync shows here)."""
    if "old_log_probs" not in batch or "rollout_log_probs" not in batch:
        return {}
    mask = batch["response_mask"].bool()
    diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[mask]
    if diff.numel() == 0:
        return {}
    worst = int(diff.argmax())
    return {"rollout/log_prob_diff_mean": float(diff.mean()), "rollout/log_prob_diff_max": float(diff[worst]),
            "rollout/log_prob_at_diff_max": float(batch["old_log_probs"][mask][worst])}
