"""``rollout/log_prob_diff_*``: the engine's sampling log-probs against the actor's recomputed ones, over the
model's response tokens only, and the actor's log-prob of the token where they differ most."""

from __future__ import annotations

import torch

from easytrain.distributed.batch import Batch
from easytrain.trainer.stats import log_prob_agreement


def test_the_gap_is_over_response_tokens_and_names_the_worst_tokens_log_prob() -> None:
    old = torch.tensor([[-0.1, -2.0, -20.0], [-0.5, -1.0, -3.0]])
    rollout = old + torch.tensor([[1e-7, 2e-7, 3e-5], [4e-7, 9.0, 0.0]])  # 9.0 sits under the mask: not counted
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    out = log_prob_agreement(Batch({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}))
    gaps = torch.tensor([1e-7, 2e-7, 3e-5, 4e-7, 0.0])
    assert abs(out["rollout/log_prob_diff_max"] - 3e-5) < 1e-6
    assert abs(out["rollout/log_prob_diff_mean"] - float(gaps.mean())) < 1e-6
    assert out["rollout/log_prob_at_diff_max"] == -20.0
    assert log_prob_agreement(Batch({"old_log_probs": old, "response_mask": mask})) == {}  # no engine log-probs
