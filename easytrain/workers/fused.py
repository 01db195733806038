"""Fused workers: one process per device hosting the actor, the reference and the rollout engine.

With ``trainer.colocate=true`` the roles that share a device share a process (the "hybrid engine" of the
peers that run VLM RL at scale): one CUDA context and one caching allocator per device, the engine put to sleep
in-process, and the actor's weights handed to the engine in-process (:func:`sync_in_process`). The driver
still talks to a group per role: each is a view of the fused group (:meth:`WorkerGroup.view`) whose calls
land in :meth:`FusedWorker.call_role`, which enters the call's phase first.

Entering a phase puts the device in the state :mod:`easytrain.memory.phases` names for it: the engine goes
to sleep before any other role computes, wakes its weights before the sync and its KV cache before generating.
Leaving a phase returns the role's cached device memory. Every transition and phase is recorded in order
(:meth:`easytrain.workers.debug.FusedDebug.phase_log`), which is how tests see what held the device when.
"""

from __future__ import annotations

import logging
import os
from collections import deque
import time
from typing import Any

import torch

from easytrain.config.schema import Config
from easytrain.config.derived import needs_reference
from easytrain.distributed.group import Dispatch, dispatch
from easytrain.distributed.ulysses import sequence_parallel_group
from easytrain.memory import peaks
from easytrain.memory.phases import engine_state
from easytrain.workers.actor import ActorWorker
from easytrain.workers.base import WorkerBase
from easytrain.workers.debug import FusedDebug, debug_bases
from easytrain.workers.reference import ReferenceWorker
from easytrain.workers.rollout.worker import RolloutWorker
from easytrain.workers.weight_sync import sync_in_process

logger = logging.getLogger(__name__)

PHASE_OF = {"generate": "generate", "compute_ref_log_probs": "ref", "compute_log_probs": "old_log_probs",
            "update": "update"}
"""The step phase (:data:`easytrain.memory.phases.STEP`) each role method computes in."""
EVENTS_KEPT = 1024
"""Phase records a worker keeps between reads of :meth:`~easytrain.workers.debug.FusedDebug.phase_log` (about
100 steps)."""


class FusedWorker(*debug_bases(FusedDebug), WorkerBase):  # type: ignore[misc]
    """The roles of one device in one process; ``role`` is ``worker``."""

    def __init__(self, config: Config, *, role: str, rank: int, world_size: int) -> None:
        super().__init__(config, role=role, rank=rank, world_size=world_size)
        self.parts: dict[str, WorkerBase] = {
            "actor": ActorWorker(config, role="actor", rank=rank, world_size=world_size),
            "rollout": RolloutWorker(config, role="rollout", rank=rank, world_size=world_size)}
        self.rollout.fused = True
        if needs_reference(config):
            self.parts["ref"] = ReferenceWorker(config, role="ref", rank=rank, world_size=world_size)
        self.events: deque[tuple[str, float]] = deque(maxlen=EVENTS_KEPT)
        """(phase or engine transition, time) in the order they happened on this device (the latest ones)."""

    @property
    def actor(self) -> ActorWorker:
        return self.parts["actor"]  # type: ignore[return-value]

    @property
    def rollout(self) -> RolloutWorker:
        return self.parts["rollout"]  # type: ignore[return-value]

    @dispatch(Dispatch.BROADCAST)
    def init_process_group(self, address: str, port: int) -> None:
        """One torch.distributed world for the process (the actor's and reference's, and vLLM's through its
        external launcher), and each training role's Ulysses group."""
        super().init_process_group(address, port)
        os.environ.update({"RANK": str(self.rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(self.world_size),
                           "MASTER_ADDR": address, "MASTER_PORT": str(port)})
        groups: dict[int, Any] = {}
        for name in ("actor", "ref"):
            size = getattr(self.config.worker, name).ulysses_size
            if name in self.parts and size > 1:
                if size not in groups:  # new_group is collective: every rank creates the same groups in order
                    groups[size] = sequence_parallel_group(self.world_size, size, self.rank)
                self.parts[name].sp = groups[size]

    # ------------------------------------------------------------------ the roles' calls

    @dispatch(Dispatch.BROADCAST)
    def call_role(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of the hosted ``role`` (what a role view sends), inside its phase."""
        if role not in self.parts:
            raise KeyError(f"this fused worker hosts {sorted(self.parts)}, not {role!r}")
        if role == "rollout" and method == "sleep":
            return self.sleep()
        phase = PHASE_OF.get(method)
        if phase is None:  # setup, memory readings, checkpoints: no phase of the step
            return getattr(self.parts[role], method)(*args, **kwargs)
        self._enter(phase)
        try:
            return getattr(self.parts[role], method)(*args, **kwargs)
        finally:
            self._leave()

    def sleep(self) -> int:
        """The engine frees its device memory (its sleep level's share) until the next sync; bytes freed."""
        engine = self.rollout.engine
        if engine is None or not engine.can_sleep or "weights" in engine.asleep:  # nothing left to free
            return 0
        freed = self.rollout.sleep()
        peaks.trim_heap()  # on CPU the dropped weights were heap blocks: back to the OS before the next role runs
        self._record("sleep")
        self._leave()
        return freed

    def _enter(self, phase: str) -> None:
        """Put the engine in the state ``phase`` runs with, recording each transition, then the phase."""
        engine = self.rollout.engine
        if engine is not None and engine.can_sleep:
            state = engine_state(phase)
            if state == "asleep":
                self.sleep()
            elif "weights" in engine.asleep:  # weights before the sync, and before a generation
                engine.wake(("weights",))
                self._record("wake_weights")
            if state == "awake" and "kv_cache" in engine.asleep:
                engine.wake(("kv_cache",))
                self._record("wake_kv")
            if phase == "generate" and engine.stale:  # dropped weights that no sync has refilled yet:
                self._sync(int(self.config.worker.rollout.sync_bucket_mb * 2**20))  # the actor's (every rank)
        self._record(phase)

    def _leave(self) -> None:
        """The phase's role hands back its cached device memory to the next one."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _record(self, name: str) -> None:
        self.events.append((name, time.time()))

    # ------------------------------------------------------------------ weights

    @dispatch(Dispatch.BROADCAST)
    def sync_weights(self, bucket_bytes: int) -> dict[str, float]:
        """The actor's weights into this process's engine, bucket by bucket (every rank gathers each bucket's
        full tensors together): see :func:`easytrain.workers.weight_sync.sync_in_process`."""
        self._enter("sync")
        try:
            return self._sync(bucket_bytes, record=False)
        finally:
            self._leave()

    def _sync(self, bucket_bytes: int, record: bool = True) -> dict[str, float]:
        assert self.rollout.engine is not None, "setup() first"
        if record:
            self._record("sync")
        return sync_in_process(self.actor.model, self.rollout.engine, bucket_bytes, self.actor.lora_scale,
                               self.rollout.engine_dtype)

    # ------------------------------------------------------------------ the process

    def busy_times(self, reset: bool = True) -> dict[str, float]:
        """Seconds inside each dispatched method of the process and of its roles since the last reset (a role
        method's time also counts in ``call_role``, so that one is left out)."""
        busy = super().busy_times(reset)
        busy.pop("call_role", None)
        return busy

    @dispatch(Dispatch.BROADCAST)
    def memory(self) -> dict[str, Any]:
        reading = super().memory()
        reading["sleep_freed_gb"] = self.rollout.freed_bytes / 2**30
        return reading


def fused_parts(config: Config) -> list[str]:
    """The roles a fused worker of ``config`` hosts."""
    return ["actor", "rollout"] + (["ref"] if needs_reference(config) else [])

