"""The order of an RL step's phases on a device that hosts every role: written once, read by the planner, run by
the driver (:mod:`easytrain.trainer.rl`, whose hand-offs the tests check against it).

With fused workers (``trainer.colocate=true``) one process per device holds the actor, the reference and the
rollout engine, and the phases take the device in turn:

    generate -> sleep -> ref -> old_log_probs -> update -> wake_weights -> sync -> wake_kv -> (next generate)

The engine sleeps before any other compute touches the device (the reference pass included) and wakes its
weights before the sync writes them and its KV cache before generating. Each role returns its cached device
memory (``torch.cuda.empty_cache``) at the end of its phase, so what one role freed is free for the next.
Scoring the responses runs on the reward actors (other processes) right after the generation.

``engine`` says what the engine holds on the device during the phase: ``awake`` (weights and KV cache),
``weights`` (weights only: woken for the sync) or ``asleep`` (what its sleep level keeps: nothing at level 2,
nothing on the device at level 1, whose weights wait in host memory).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    role: str
    """The role that computes in this phase (``engine`` for the engine's own transitions)."""
    engine: str
    """What the rollout engine holds on the device meanwhile: ``awake``, ``weights`` or ``asleep``."""
    planned: str = ""
    """The memory plan's row for this phase (:data:`easytrain.memory.planner.PHASES`), if it has one."""


STEP: tuple[Phase, ...] = (
    Phase("generate", "rollout", "awake", "generation"),
    Phase("sleep", "engine", "asleep"),
    Phase("ref", "ref", "asleep", "ref_log_probs"),
    Phase("old_log_probs", "actor", "asleep", "old_log_probs"),
    Phase("update", "actor", "asleep", "update"),
    Phase("wake_weights", "engine", "weights"),
    Phase("sync", "actor", "weights", "weight_sync"),
    Phase("wake_kv", "engine", "awake"),
)
"""One RL step on a shared device, in the order it runs (the driver skips phases a run has none of: no
reference without a KL term, no old log-probs when they are reused on-policy, no sleep where the engine
cannot)."""

ORDER: tuple[str, ...] = tuple(p.name for p in STEP)
