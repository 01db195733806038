"""The reference policy: a frozen copy of the initial model giving log-probs for the KL term."""

from __future__ import annotations

from typing import Any

import torch

from easytrain.config.schema import Config
from easytrain.distributed.batch import Batch
from easytrain.distributed.group import Dispatch, dispatch
from easytrain.workers.base import WorkerBase, build_sharded_model
from easytrain.workers.forward import batch_log_probs, planned_log_probs


class ReferenceWorker(WorkerBase):
    def __init__(self, config: Config, *, role: str, rank: int, world_size: int) -> None:
        super().__init__(config, role=role, rank=rank, world_size=world_size)
        self.model: Any = None

    @dispatch(Dispatch.BROADCAST)
    def setup(self) -> dict[str, int]:
        self.model = build_sharded_model(self.config, self.config.worker.ref, self.folder, self.device,
                                         self.world_size, trainable=False, sp=self.sp)
        return {"total": sum(p.numel() for p in self.model.parameters())}

    @dispatch(Dispatch.SCATTER)
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        size = self.config.worker.actor.micro_batch_size_per_device_for_experience
        log_probs = batch_log_probs(self.model, batch, size, self.config.worker.rollout.temperature, self.device,
                                    self.config.worker.actor.share_prompt)
        return Batch({"ref_log_probs": log_probs})

    @dispatch(Dispatch.EACH)
    def compute_ref_log_probs_planned(self, micro_batches: list[Batch]) -> list[torch.Tensor]:
        """Reference log-probs of this rank's padding-free micro batches (planned by the driver)."""
        return planned_log_probs(self.model, micro_batches, self.config.worker.rollout.temperature, self.device,
                                 self.sp, self.config.worker.actor.share_prompt)
