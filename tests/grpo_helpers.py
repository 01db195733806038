"""Shared by the GRPO worker tests."""

from __future__ import annotations

from typing import Any

from easytrain.config import Config, load


def make_config(tmp: str, *extra: str) -> Config:
    return load([f"trainer.output_dir={tmp}", "data.num_workers=0", "data.synthetic_size=32",
                 "data.synthetic_val_size=8", "worker.rollout.n=2", "data.rollout_batch_size=4",
                 "worker.actor.global_batch_size=4", "worker.actor.micro_batch_size_per_device_for_update=2",
                 "worker.actor.optim.lr=1e-3", "data.max_response_length=8", *extra])


def log_probs(group: Any, method: str, batch: Any, config: Config) -> Any:
    """``group``'s ``method`` (compute_log_probs / compute_ref_log_probs) over ``batch`` as the driver plans it."""
    from easytrain.trainer.micro_batches import Forward, run_log_probs

    return run_log_probs(group, method, batch, config, Forward.of(config, {}))


def generate(group: Any, prompts: Any, step: int, config: Config) -> Any:
    """The rollout group's training batch for ``prompts``, with the prompts' visuals put back as the driver does."""
    from easytrain.trainer.rl import with_prompt_visuals

    return with_prompt_visuals(group.call("generate", prompts, step), prompts, config.worker.rollout.n)


def update(group: Any, batch: Any, config: Config, kl_coef: float) -> list[dict[str, float]]:
    """``group``'s PPO update over ``batch`` as the driver plans it: each member's summed metrics."""
    from easytrain.trainer.micro_batches import Forward, run_update

    return run_update(group, batch, config, Forward.of(config, {}), kl_coef)


def trained_weights(config: Config) -> dict[str, Any]:
    """Run ``config`` to its end (resuming from its run folder's latest checkpoint, if any) and return the actor's
    full weights."""
    from easytrain.trainer.rl import RLTrainer

    trainer = RLTrainer(config)
    try:
        trainer.fit()
        return trainer.roles.actor.call("full_state_dict")
    finally:
        trainer.close()
