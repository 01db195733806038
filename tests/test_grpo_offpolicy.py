"""Off-policy, multi-epoch GRPO through the real trainer, against a plain PyTorch implementation.

The shipped GPU presets take several optimizer steps per rollout batch
(512 prompts / 128 per step) with recomputed old log-probs, so the
importance ratio leaves 1 and the clip bounds act. Here one real
``RLTrainer.train_step`` (real rollout, reference and FSDP actor workers on
Ray, 1 or 2 ranks) runs 4 optimizer steps per rollout batch for 2 PPO epochs
(8 optimizer steps) or for 1 (4 steps: the old log-probs must still be
computed before the first, since the later steps are off-policy), warm-up then
cosine decay, KL loss against the reference, tight clip bounds so that the
lower, upper and dual clips all act.

The reference below is written from the published formulas (PPO's clipped
surrogate with separate bounds, dual clip for negative advantages, GRPO's
group-normalised advantages, the k3 KL estimator, the two loss aggregation
modes) on one in-process copy of the initial weights with torch's AdamW; it
shares no code with easytrain's loss, advantage, schedule or update paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from easytrain.config import Config, load
from easytrain.distributed.batch import Batch
from easytrain.models.hf import load_model, model_folder
from easytrain.trainer.rl import RLTrainer

from reference import aggregate, grpo_advantages, kl_estimate, lr_at, ppo_token_loss
from tolerance import assert_updates_agree

pytestmark = pytest.mark.slow

N, PROMPTS, PER_STEP_PROMPTS, RESPONSE = 4, 8, 2, 6
LR, WARMUP, BETAS, WEIGHT_DECAY, MAX_NORM = 3e-3, 3, (0.9, 0.999), 0.01, 0.5
CLIP_LOW, CLIP_HIGH, CLIP_DUAL, KL_COEF, TEMPERATURE = 0.02, 0.03, 1.5, 0.05, 0.9
SYNTHETIC_SIZE, EPOCHS_OF_DATA = 32, 2
STOPS = [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
"""Single-letter tokens that end a response (~5% of the random model's draws): responses of varied lengths, so
the response mask and the per-sequence means matter."""
SPREAD = Path(__file__).parent / "assets" / "spread_reward.py"  # scores spread over any responses: non-zero advantages
VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


class RecordingTrainer(RLTrainer):
    """The real trainer; it only keeps each training generation (the batch and its scores) for the reference."""

    generated: list[tuple[Batch, dict[str, torch.Tensor]]]

    def start_scoring(self, batch: Batch) -> Callable[..., dict[str, torch.Tensor]]:
        scoring = super().start_scoring(batch)

        def recorded(timer: Any, validate: bool = False) -> dict[str, torch.Tensor]:
            scores = scoring(timer, validate)
            if not validate:
                self.__dict__.setdefault("generated", []).append((batch, scores))
            return scores
        return recorded


def offpolicy_config(tmp: Path, ranks: int, mode: str, epochs: int) -> Config:
    return load([
        f"trainer.output_dir={tmp}", "trainer.loggers=[jsonl]", f"trainer.workers_per_node={ranks}",
        "data.num_workers=0", f"data.synthetic_size={SYNTHETIC_SIZE}", "data.synthetic_val_size=4",
        f"trainer.total_epochs={EPOCHS_OF_DATA}", f"data.rollout_batch_size={PROMPTS}",
        f"data.max_response_length={RESPONSE}", f"worker.rollout.n={N}", f"worker.rollout.temperature={TEMPERATURE}",
        f"worker.rollout.stop_tokens=[{','.join(STOPS)}]",
        f"worker.actor.global_batch_size={PER_STEP_PROMPTS}", f"worker.actor.ppo_epochs={epochs}",
        "worker.actor.micro_batch_size_per_device_for_update=2", f"worker.actor.loss_agg_mode={mode}",
        f"worker.actor.clip_ratio_low={CLIP_LOW}", f"worker.actor.clip_ratio_high={CLIP_HIGH}",
        f"worker.actor.clip_ratio_dual={CLIP_DUAL}", f"worker.actor.optim.lr={LR}",
        f"worker.actor.optim.warmup_steps={WARMUP}", "worker.actor.optim.scheduler=cosine",
        f"worker.actor.optim.weight_decay={WEIGHT_DECAY}", f"worker.actor.optim.max_grad_norm={MAX_NORM}",
        "algorithm.use_kl_loss=true", f"algorithm.kl_coef={KL_COEF}", "algorithm.kl_penalty=low_var_kl",
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std=true", f"reward.function={SPREAD}:spread",
    ])


# ---------------------------------------------------------------------- the reference, from the formulas

def response_log_probs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """log softmax(logits / T) at each response token, vision tokens excluded from the distribution."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "pixel_values",
                                     "image_grid_thw", "mm_token_type_ids") if k in batch}
    logits = model(**inputs, use_cache=False).logits.float()
    width = batch["responses"].shape[1]
    logits = logits[:, -width - 1:-1] / TEMPERATURE
    banned = [getattr(model.config, n) for n in VISION_TOKENS if getattr(model.config, n, None) is not None]
    logits[..., banned] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def clip_counts(log_probs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor) -> dict[str, torch.Tensor]:
    """Where each clip bound acts, and ratios within 1e-4 of a bound (rounding may put them either side)."""
    ratio, a = torch.exp(log_probs - old), advantages[:, None]
    surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    return {"low": (a < 0) & (ratio < 1 - CLIP_LOW), "high": (a > 0) & (ratio > 1 + CLIP_HIGH),
            "dual": (a < 0) & (surrogate > -a * CLIP_DUAL),
            "near_bound": torch.stack([(ratio - b).abs() < 1e-4 for b in (1 - CLIP_LOW, 1 + CLIP_HIGH, CLIP_DUAL)]).any(0)}


def reference_run(config: Config, initial: dict[str, torch.Tensor], batch: Batch,
                  rewards: torch.Tensor, total_steps: int) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """The update written out: old log-probs from the initial weights, then ``ppo_epochs`` passes over mini
    batches of PER_STEP_PROMPTS * N rows in order, one AdamW step each."""
    model = load_model(config.model, model_folder(config.model), dtype="float32")
    model.load_state_dict(initial)
    model.config.use_cache = False
    mask = batch["response_mask"].float()
    with torch.no_grad():
        old = response_log_probs(model.eval(), batch)
    advantages = grpo_advantages(rewards, N)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    rows, steps = PER_STEP_PROMPTS * N, []
    for k in range(config.worker.actor.ppo_epochs * (PROMPTS // PER_STEP_PROMPTS)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(k, "cosine", WARMUP, total_steps, LR)
        part = list(range((k * rows) % len(batch), (k * rows) % len(batch) + rows))
        mini, m = batch.select(part), mask[part]
        lp = response_log_probs(model, mini)
        a = advantages[part][:, None]
        terms = {"loss": ppo_token_loss(lp, old[part], a, CLIP_LOW, CLIP_HIGH, CLIP_DUAL),
                 "kl": kl_estimate(lp, old[part], "low_var_kl"),  # the reference is the initial policy
                 **clip_counts(lp, old[part], advantages[part])}
        mode = config.worker.actor.loss_agg_mode
        loss = aggregate(terms["loss"], m, mode) + KL_COEF * aggregate(terms["kl"], m, mode)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        counted = {name: float((terms[name].float() * m).sum()) for name in ("low", "high", "dual", "near_bound")}
        steps.append({"pg_loss_sum": float((terms["loss"].detach() * m).sum()),
                      "kl_sum": float((terms["kl"].detach() * m).sum()), "tokens": float(m.sum()),
                      "grad_norm": float(norm), "lr": group["lr"], **counted})
    return steps, {k: v.detach() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- the test

def combined(per_rank: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """The ranks' per-step sums added up (the gradient norm and rate are global: rank 0's)."""
    steps = []
    for k, first in enumerate(per_rank[0]):
        total = {key: sum(rank[k][key] for rank in per_rank) for key in first}
        steps.append({**total, "actor/grad_norm_sum": first["actor/grad_norm_sum"], "actor/lr": first["actor/lr"]})
    return steps


@pytest.mark.parametrize("ranks,mode,epochs", [(1, "token-mean", 2), (2, "seq-mean-token-mean", 1)])
def test_offpolicy_update_equals_the_formulas(ray_local: None, tmp_path: Path, ranks: int, mode: str,
                                              epochs: int) -> None:
    config = offpolicy_config(tmp_path, ranks, mode, epochs)
    trainer = RecordingTrainer(config)
    try:
        initial = trainer.roles.actor.call("full_state_dict")
        trainer.step = 1
        metrics = trainer.train_step().metrics
        got = combined(trainer.roles.actor.call("update_steps"))
        final = trainer.roles.actor.call("full_state_dict")
    finally:
        trainer.roles.shutdown()
    (batch, scores), = trainer.generated
    assert batch.meta["uids"] == [u for u in dict.fromkeys(batch.meta["uids"]) for _ in range(N)]  # grouped rows
    lengths = batch["response_mask"].sum(1)
    assert 0 < int((lengths < RESPONSE).sum()) < len(batch) // 2, lengths  # some stopped early, most did not
    total = (SYNTHETIC_SIZE // PROMPTS) * EPOCHS_OF_DATA * (PROMPTS // PER_STEP_PROMPTS) * epochs
    expected, weights = reference_run(config, initial, batch, scores["overall"].float(), total)

    assert len(got) == len(expected) == 4 * epochs
    assert not trainer.on_policy  # one epoch of several steps still needs the old log-probs
    for k, (step, want) in enumerate(zip(got, expected)):
        scale = want["tokens"]  # per-token terms are O(1): sums agree to float32 rounding times the token count
        assert step["actor/lr"] == pytest.approx(want["lr"], rel=1e-6), k
        assert step["actor/tokens"] == want["tokens"], k
        assert step["actor/pg_loss_sum"] == pytest.approx(want["pg_loss_sum"], abs=1e-4 * scale), k
        assert step["actor/kl_loss_sum"] == pytest.approx(want["kl_sum"], abs=1e-5 * scale), k
        assert step["actor/grad_norm_sum"] == pytest.approx(want["grad_norm"], rel=1e-3), k
        clipped, dual = step["actor/clipfrac_sum"], step["actor/dual_clipfrac_sum"]
        # a token whose ratio sits within 1e-4 of a bound may fall either side of it under rounding
        assert abs(clipped - (want["low"] + want["high"])) <= want["near_bound"], k
        assert abs(dual - want["dual"]) <= want["near_bound"], k
    # the off-policy machinery acted: every clip bound and the KL term, after the first (on-policy) step
    assert expected[0]["low"] + expected[0]["high"] + expected[0]["dual"] == 0
    assert sum(s["low"] for s in expected) > 0 and sum(s["high"] for s in expected) > 0
    assert sum(s["dual"] for s in expected) > 0
    assert expected[-1]["kl_sum"] > 1e-3 * expected[-1]["tokens"]
    assert metrics["actor/lr"] == pytest.approx(expected[-1]["lr"], rel=1e-6)
    assert_updates_agree(final, {k: weights[k] for k in final}, initial, lr=LR, steps=len(expected))
