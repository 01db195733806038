"""Facts derived from a config (and from the environment it runs in) that validation and the runtime share.

Pure arithmetic on :class:`~easytrain.config.schema.Config`, no imports beyond the schema: the trainer, the
workers, the cluster checks and the launchers take these from here rather than each working them out.
"""

from __future__ import annotations

import os

from easytrain.config.schema import Config

RAY_KILL_DEFAULT = 0.95
"""Ray's memory monitor's kill line (node RAM fraction) when ``RAY_memory_usage_threshold`` is unset."""


def world_size(cfg: Config) -> int:
    """Worker processes of the run: nodes x workers per node."""
    return cfg.trainer.nnodes * cfg.trainer.workers_per_node


def needs_reference(config: Config) -> bool:
    """A reference group is needed for a KL term, unless LoRA lets the actor serve it (adapters off)."""
    return config.algorithm.kl_coef > 0 and config.model.lora.rank == 0


def ray_kill_threshold() -> float:
    """Ray's memory monitor kills workers above this node RAM fraction: ``RAY_memory_usage_threshold`` of the
    environment easytrain runs (or launches) from, else Ray's default; the watchdog's thresholds stay below it."""
    try:
        return float(os.environ.get("RAY_memory_usage_threshold", str(RAY_KILL_DEFAULT)))
    except ValueError:
        return RAY_KILL_DEFAULT
