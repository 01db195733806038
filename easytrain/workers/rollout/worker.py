"""The rollout worker: hosts one engine, generates for its share of prompts, takes new weights."""

from __future__ import annotations

from typing import Any, Optional

import torch

from easytrain.config.schema import Config
from easytrain.distributed.batch import Batch
from easytrain.distributed.group import Dispatch, dispatch
from easytrain.models.hf import load_model, load_tokenizer
from easytrain.workers.base import WorkerBase
from easytrain.workers.rollout.engine import RolloutEngine, SamplingParams, engine_class
from easytrain.workers.sequences import assemble


class RolloutWorker(WorkerBase):
    def __init__(self, config: Config, *, role: str, rank: int, world_size: int) -> None:
        super().__init__(config, role=role, rank=rank, world_size=world_size)
        self.engine: Optional[RolloutEngine] = None

    @dispatch(Dispatch.BROADCAST)
    def setup(self) -> dict[str, Any]:
        tokenizer = load_tokenizer(self.config.model, self.folder)
        eos = [tokenizer.eos_token_id]
        if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in eos:
            eos.append(tokenizer.pad_token_id)  # <|endoftext|> also ends a Qwen response
        model = load_model(self.config.model, self.folder).to(self.device)
        engine_cls = engine_class(self.config.worker.rollout.engine)
        self.engine = engine_cls(model, eos, tokenizer.pad_token_id, self.device)
        self.merge_size = int(getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", 2))
        return {"engine": self.config.worker.rollout.engine}

    def sampling(self, validate: bool, step: int) -> SamplingParams:
        r = self.config.worker.rollout
        seed = self.config.trainer.seed * 1_000_003 + step * 1009 + self.rank
        if validate:  # one greedy response per prompt
            return SamplingParams(1, 0.0, 1.0, -1, self.config.data.max_response_length, seed)
        return SamplingParams(r.n, r.temperature, r.top_p, r.top_k, self.config.data.max_response_length, seed)

    @dispatch(Dispatch.SCATTER)
    def generate(self, prompts: Batch, step: int, validate: bool = False) -> Batch:
        assert self.engine is not None, "setup() first"
        params = self.sampling(validate, step)
        generated = self.engine.generate(prompts, params)
        return assemble(prompts, generated, params.n, self.merge_size)

    @dispatch(Dispatch.BROADCAST)
    def update_weights(self, state: dict[str, torch.Tensor]) -> int:
        assert self.engine is not None, "setup() first"
        return self.engine.update_weights(state.items())
