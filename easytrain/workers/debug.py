"""Remote methods only the tests (and the benches that split a step's time) call: busy time per method, what a sync delivered, where the weights live, each optimizer step's
sums, the order of a fused worker's phases. They are mixed into the worker classes where the environment sets
:data:`DEBUG_ENV` to ``1`` when the class is defined (``tests/conftest.py`` does, before anything imports the
workers; Ray's worker processes inherit it), and are absent from a run's remote surface otherwise."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from easytrain.distributed.group import Dispatch, busy_times, dispatch

DEBUG_ENV = "EASYTRAIN_DEBUG_METHODS"


def debug_bases(mixin: type) -> tuple[type, ...]:
    """``(mixin,)`` where the tests enabled the debug methods, else nothing: a worker class's extra bases."""
    return (mixin,) if os.environ.get(DEBUG_ENV) == "1" else ()


class WorkerDebug:
    """Every worker's measurement hook, for tests and the benches that split a step's time (they enable it too)."""

    def busy_times(self: Any, reset: bool = True) -> dict[str, float]:
        """Seconds this process spent inside each outermost dispatched call since the last reset."""
        return busy_times(reset)


class ActorDebug:
    """An actor rank's test-only readings (the host class has ``model``, ``strategy``, ``last_update``)."""

    @dispatch(Dispatch.BROADCAST)
    def update_steps(self: Any) -> list[dict[str, float]]:
        """Per optimizer step of the last update, this rank's sums (pg loss, KL, clipped tokens, tokens) and
        the step's global gradient norm and learning rate: what the driver's step metrics add up."""
        return self.last_update

    @dispatch(Dispatch.BROADCAST)
    def placement(self: Any) -> dict[str, Any]:
        """Where this rank's parameters and optimizer states live and which offload policy FSDP holds."""
        from easytrain.distributed.fsdp import offload_policies, parameter_devices

        return {"offload_policies": sorted(set(offload_policies(self.model))),
                "param_devices": sorted(parameter_devices(self.model)),
                "optimizer_state_devices": self.strategy.optimizer_state_devices()}

    @dispatch(Dispatch.RANK0)
    def full_state_dict(self: Any) -> Optional[dict[str, torch.Tensor]]:
        """Full (unsharded) weights in HF names on rank 0, on CPU; every rank must take part."""
        from easytrain.workers.weight_sync import to_hf_names

        state = self.strategy.full_state_dict()
        return to_hf_names(state, self.lora_scale) if self.rank == 0 else None


class RolloutDebug:
    """A rollout rank's test-only reading (the host class has ``engine``)."""

    @dispatch(Dispatch.BROADCAST)
    def engine_weights(self: Any) -> dict[str, torch.Tensor]:
        """The HF engine's current weights by name, on CPU (to check what a sync delivered)."""
        model = getattr(self.engine, "model", None)
        if model is None:
            raise NotImplementedError(f"the {self.config.worker.rollout.engine} engine does not expose its weights")
        return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}


class FusedDebug:
    """A fused worker's test-only entries (the host class records ``events`` and hosts the roles): its phase
    log, and the roles' test-only readings, which the role views address in this process."""

    @dispatch(Dispatch.BROADCAST)
    def phase_log(self: Any, reset: bool = True) -> list[tuple[str, float]]:
        """The phases and engine transitions since the last reset, in order."""
        events = list(self.events)
        if reset:
            self.events.clear()
        return events

    @dispatch(Dispatch.BROADCAST)
    def update_steps(self: Any) -> list[dict[str, float]]:
        return self.actor.update_steps()

    @dispatch(Dispatch.BROADCAST)
    def placement(self: Any) -> dict[str, Any]:
        return self.actor.placement()

    @dispatch(Dispatch.RANK0)
    def full_state_dict(self: Any) -> Optional[dict[str, torch.Tensor]]:
        return self.actor.full_state_dict()

    @dispatch(Dispatch.BROADCAST)
    def engine_weights(self: Any) -> dict[str, torch.Tensor]:
        return self.rollout.engine_weights()

    @dispatch(Dispatch.RANK0)
    def push_weights(self: Any, targets: list[Any], bucket_bytes: int) -> dict[str, float]:
        """The object-store path out of this process's actor, to an engine in another group (a test's)."""
        return self.actor.push_weights(targets, bucket_bytes)

    # the object-store path into this process's engine from an actor in another group (a test's LoRA actor
    # beside the fused roles); a run's fused actor always syncs in process (FusedWorker.sync_weights)

    def begin_weight_update(self: Any, lora_scale: float = 1.0, partial: bool = False) -> None:
        self._record("sync")
        self.rollout.begin_weight_update(lora_scale, partial)

    def receive_part(self: Any, index: int, part: int, parts: int, wire: dict[str, Any]) -> None:
        self.rollout.receive_part(index, part, parts, wire)

    def finish_weight_update(self: Any) -> dict[str, float]:
        return self.rollout.finish_weight_update()
