"""The reference policy: a frozen copy of the initial model giving log-probs for the KL term."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from easytrain.config.schema import Config
from easytrain.distributed.batch import MicroBatch
from easytrain.distributed.group import Dispatch, dispatch
from easytrain.workers.base import WorkerBase, build_sharded_model
from easytrain.workers.forward import micro_log_probs


class ReferenceWorker(WorkerBase):
    def __init__(self, config: Config, *, role: str, rank: int, world_size: int, hosted: bool = False) -> None:
        super().__init__(config, role=role, rank=rank, world_size=world_size, hosted=hosted)
        self.model: Any = None

    @dispatch(Dispatch.BROADCAST)
    def setup(self) -> dict[str, int]:
        self.model = build_sharded_model(self.config, self.config.worker.ref, self.folder, self.device,
                                         self.world_size, trainable=False, sp=self.sp)
        return {"total": sum(p.numel() for p in self.model.parameters())}

    @dispatch(Dispatch.EACH)
    def compute_ref_log_probs(self, micros: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """Reference log-probs of this rank's planned micro batches, one (B, R) each."""
        return micro_log_probs(self.model, micros, self.config.worker.rollout.temperature, self.device, self.sp)
