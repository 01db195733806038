"""Fused workers: one process per device hosting the actor, the reference and the rollout engine.

With ``trainer.colocate=true`` the roles that share a device share a process (the "hybrid engine" of the
peers that run VLM RL at scale): one CUDA context and one caching allocator per device, the engine put to sleep
in-process, and the actor's weights handed to the engine in-process (:func:`sync_in_process`). The driver
still talks to a group per role: each is a view of the fused group (:meth:`WorkerGroup.view`), whose calls
land in this class's remote methods, one per operation of the step.

The device changes hands only where the driver says so: :meth:`FusedWorker.sleep` and :meth:`FusedWorker.wake`
are calls of their own, which the driver makes at the points :mod:`easytrain.memory.phases` writes down
(:meth:`easytrain.trainer.roles.Roles.sleep_engine` and ``wake_engine``). A phase's call only computes, then
returns its role's cached device memory. An engine asked to generate asleep, or to take weights it dropped,
raises. Every phase and transition is recorded in order
(:meth:`easytrain.workers.debug.FusedDebug.phase_log`), which is how tests see what held the device when.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any, Callable, Sequence, TypeVar

import torch

from easytrain.config.derived import needs_reference
from easytrain.config.schema import Config
from easytrain.distributed.batch import Batch, MicroBatch
from easytrain.distributed.group import Dispatch, dispatch
from easytrain.distributed.ulysses import sequence_parallel_group
from easytrain.memory import peaks
from easytrain.workers.actor import ActorWorker
from easytrain.workers.base import WorkerBase
from easytrain.workers.debug import FusedDebug, debug_bases
from easytrain.workers.reference import ReferenceWorker
from easytrain.workers.rollout.worker import RolloutWorker
from easytrain.workers.weight_sync import sync_in_process


T = TypeVar("T")
EVENTS_KEPT = 1024
"""Phase records a worker keeps between reads of :meth:`~easytrain.workers.debug.FusedDebug.phase_log` (about
100 steps)."""


class FusedWorker(*debug_bases(FusedDebug), WorkerBase):  # type: ignore[misc]
    """The roles of one device in one process; ``role`` is ``worker``."""

    def __init__(self, config: Config, *, role: str, rank: int, world_size: int) -> None:
        super().__init__(config, role=role, rank=rank, world_size=world_size)
        self.parts: dict[str, WorkerBase] = {
            "actor": ActorWorker(config, role="actor", rank=rank, world_size=world_size, hosted=True),
            "rollout": RolloutWorker(config, role="rollout", rank=rank, world_size=world_size, hosted=True)}
        self.rollout.fused = True
        if needs_reference(config):
            self.parts["ref"] = ReferenceWorker(config, role="ref", rank=rank, world_size=world_size, hosted=True)
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

    @property
    def reference(self) -> WorkerBase:
        """The part that answers reference log-probs: the reference, or the actor with its LoRA adapters off."""
        return self.parts.get("ref", self.actor)

    @dispatch(Dispatch.BROADCAST)
    def setup(self, total_optimizer_steps: int) -> dict[str, dict[str, Any]]:
        """Every hosted role's setup, by role (the actor's model and optimizer, the engine, the reference)."""
        out = {"actor": self.actor.setup(total_optimizer_steps), "rollout": self.rollout.setup()}
        if "ref" in self.parts:
            out["ref"] = self.parts["ref"].setup()
        return out

    # ------------------------------------------------------------------ the step's phases

    def _phase(self, name: str, run: Callable[[], T]) -> T:
        """Record phase ``name``, run it, then hand back its role's cached device memory."""
        self._record(name)
        try:
            return run()
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @dispatch(Dispatch.SCATTER)
    def generate(self, prompts: Batch, step: int, validate: bool = False, call: int = 0) -> Batch:
        return self._phase("generate", lambda: self.rollout.generate(prompts, step, validate, call))

    @dispatch(Dispatch.EACH)
    def compute_ref_log_probs(self, micros: Sequence[MicroBatch]) -> list[torch.Tensor]:
        return self._phase("ref", lambda: self.reference.compute_ref_log_probs(micros))

    @dispatch(Dispatch.EACH)
    def compute_log_probs(self, micros: Sequence[MicroBatch]) -> list[torch.Tensor]:
        return self._phase("old_log_probs", lambda: self.actor.compute_log_probs(micros))

    @dispatch(Dispatch.EACH)
    def update(self, steps: Sequence[Sequence[MicroBatch]], kl_coef: float) -> dict[str, float]:
        return self._phase("update", lambda: self.actor.update(steps, kl_coef))

    @dispatch(Dispatch.BROADCAST)
    def sync_weights(self, bucket_bytes: int) -> dict[str, float]:
        """The actor's weights into this process's engine, bucket by bucket (every rank gathers each bucket's
        full tensors together): see :func:`easytrain.workers.weight_sync.sync_in_process`. The engine holds
        its weights' room (awake, or its weights woken)."""
        engine = self.rollout.engine
        assert engine is not None, "setup() first"
        if "weights" in engine.asleep:
            raise RuntimeError("sync_weights: the engine's weights sleep; wake them first (Roles.wake_engine)")
        return self._phase("sync", lambda: sync_in_process(self.actor.model, engine, bucket_bytes,
                                                           self.actor.lora_scale, self.rollout.engine_dtype))

    @dispatch(Dispatch.BROADCAST)
    def sleep(self) -> int:
        """The engine frees its device memory (its sleep level's share) until it is woken; bytes freed."""
        freed = self.rollout.sleep()
        peaks.trim_heap()  # on CPU the dropped weights were heap blocks: back to the OS before the next role runs
        self._record("sleep")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    @dispatch(Dispatch.BROADCAST)
    def wake(self, tags: Sequence[str]) -> None:
        """The engine takes back ``weights`` (before a sync) or its ``kv_cache`` (before generating)."""
        self.rollout.wake(tags)
        for tag in tags:
            self._record("wake_weights" if tag == "weights" else "wake_kv")

    def _record(self, name: str) -> None:
        self.events.append((name, time.time()))

    # ------------------------------------------------------------------ the actor's checkpoints

    @dispatch(Dispatch.BROADCAST)
    def save_checkpoint(self, folder: str, background: bool = False) -> dict[str, float]:
        return self.actor.save_checkpoint(folder, background)

    @dispatch(Dispatch.BROADCAST)
    def checkpoint_files(self, folder: str) -> dict[str, Any]:
        return self.actor.checkpoint_files(folder)

    @dispatch(Dispatch.BROADCAST)
    def checkpoint_written(self) -> bool:
        return self.actor.checkpoint_written()

    @dispatch(Dispatch.BROADCAST)
    def wait_checkpoint(self) -> dict[str, float]:
        return self.actor.wait_checkpoint()

    @dispatch(Dispatch.RANK0)
    def load_checkpoint(self, folder: str) -> dict[str, Any]:
        return self.actor.load_checkpoint(folder)

    # ------------------------------------------------------------------ the process

    @dispatch(Dispatch.BROADCAST)
    def memory(self) -> dict[str, Any]:
        reading = super().memory()
        reading["sleep_freed_gb"] = self.rollout.freed_bytes / 2**30
        return reading
