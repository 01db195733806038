"""Shared by the GRPO worker tests."""

from __future__ import annotations

from typing import Any

from easytrain.config import Config, load


def make_config(tmp: str, *extra: str) -> Config:
    return load([f"trainer.output_dir={tmp}", "data.num_workers=0", "data.synthetic_size=32",
                 "data.synthetic_val_size=8", "worker.rollout.n=2", "data.rollout_batch_size=4",
                 "worker.actor.global_batch_size=4", "worker.actor.micro_batch_size_per_device_for_update=2",
                 "worker.actor.optim.lr=1e-3", "data.max_response_length=8", *extra])


from grpo_helpers import make_config, trained_weights, update
