"""The actor: the policy being trained (FSDP2), its log-probs, its update, and its weights for the rollout."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from easytrain.algorithms.kl import kl_penalty
from easytrain.algorithms.losses import aggregate, masked_sum, policy_loss
from easytrain.config.schema import Config
from easytrain.distributed.batch import MicroBatch
from easytrain.distributed.checkpoint import BackgroundSave
from easytrain.memory.host import host_buffer_bytes
from easytrain.distributed.deepspeed import parameter_count
from easytrain.distributed.group import Dispatch, dispatch
from easytrain.distributed.strategy import TrainStrategy
from easytrain.workers.base import WorkerBase, build_sharded_model, build_strategy
from easytrain.workers.debug import ActorDebug, debug_bases
from easytrain.workers.forward import log_probs_of, micro_log_probs
from easytrain.workers.shared_prompt import supports_shared_prompt, text_config
from easytrain.workers.weight_sync import push_weights

logger = logging.getLogger(__name__)


class ActorWorker(*debug_bases(ActorDebug), WorkerBase):  # type: ignore[misc]
    def __init__(self, config: Config, *, role: str, rank: int, world_size: int, hosted: bool = False) -> None:
        super().__init__(config, role=role, rank=rank, world_size=world_size, hosted=hosted)
        self.cfg = config.worker.actor
        self.model: Any = None
        self.strategy: Optional[TrainStrategy] = None
        self.last_update: list[dict[str, float]] = []
        """This rank's sums of each optimizer step of the last update, in order (the tests read them:
        :meth:`easytrain.workers.debug.ActorDebug.update_steps`)."""
        self.background_save: Optional[BackgroundSave] = None
        """A checkpoint this rank is writing in the background (``trainer.checkpoint_async``)."""
        self.frozen_pushed = False
        """The rollout workers have the frozen weights from an earlier :meth:`push_weights` (restarts rebuild both)."""

    @dispatch(Dispatch.BROADCAST)
    def setup(self, total_optimizer_steps: int) -> dict[str, int]:
        """Build the sharded model and its optimizer; parameter counts, and what the driver's micro-batch plan
        needs to know of the model (whether its attention can run a prompt once for several responses, its
        hidden size)."""
        model = build_sharded_model(self.config, self.cfg, self.folder, self.device, self.world_size,
                                    trainable=True, shard=self.cfg.strategy == "fsdp", sp=self.sp)
        params = [p for p in model.parameters() if p.requires_grad]
        counts = {"trainable": sum(map(parameter_count, params)),
                  "total": sum(map(parameter_count, model.parameters())),
                  "shares_prompt": int(supports_shared_prompt(model)), "hidden_size": text_config(model).hidden_size}
        self.strategy = build_strategy(model, self.cfg, total_optimizer_steps, compute_dtype=self.config.model.dtype)
        self.model = self.strategy.model
        return counts

    @dispatch(Dispatch.EACH)
    def compute_log_probs(self, micros: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """Old log-probs under the current weights (no grad) of this rank's planned micro batches, one (B, R)
        each."""
        self.model.eval()
        return micro_log_probs(self.model, micros, self.config.worker.rollout.temperature, self.device, self.sp)

    @dispatch(Dispatch.EACH)
    def compute_ref_log_probs(self, micros: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """With LoRA the reference is this model with its adapters disabled: no second copy."""
        if self.config.model.lora.rank == 0:
            raise RuntimeError("the actor serves reference log-probs only with LoRA (model.lora.rank > 0)")
        self.model.eval()
        with self.model.disable_adapter():
            return micro_log_probs(self.model, micros, self.config.worker.rollout.temperature, self.device, self.sp)

    @dispatch(Dispatch.EACH)
    def update(self, steps: Sequence[Sequence[MicroBatch]], kl_coef: float) -> dict[str, float]:
        """PPO epochs over this rank's planned micro batches, a list per optimizer step; returns summed metrics
        for the driver."""
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        self.last_update = []
        for _ in range(self.cfg.ppo_epochs):
            for micros in steps:
                step = self._optimizer_step(micros, kl_coef)
                self.last_update.append(step)
                for key, value in step.items():
                    sums[key] += value
                sums["actor/lr"] = step["actor/lr"]  # a rate, not a sum: the last step's
        self.strategy.zero_grad()  # type: ignore[union-attr]
        return dict(sums)

    def _optimizer_step(self, micros: Sequence[MicroBatch], kl_coef: float) -> dict[str, float]:
        algo, temperature = self.config.algorithm, self.config.worker.rollout.temperature
        mode = self.cfg.loss_agg_mode
        local = sum(float(m.batch["response_mask"].sum()) if mode == "token-mean" else float(len(m)) for m in micros)
        normaliser = torch.tensor([local], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(normaliser)
        # The strategies average gradients over all ranks; the ranks of a sequence-parallel group hold the same
        # samples (counted once each) and their gradients add up to the sample's: scale for a global mean.
        sp_size = self.sp.size if self.sp is not None else 1
        scale = float(normaliser) / sp_size / self.world_size
        sums: dict[str, float] = defaultdict(float)
        strategy = self.strategy
        assert strategy is not None
        strategy.zero_grad()
        for planned in micros:
            micro = planned.batch
            mask = micro["response_mask"].to(self.device, torch.float32)
            log_probs, entropy = log_probs_of(self.model, planned, temperature, self.device, self.sp,
                                              with_entropy=True)
            old = micro["old_log_probs"].to(self.device) if "old_log_probs" in micro else log_probs.detach()
            advantages = micro["advantages"].to(self.device)
            token_loss, info = policy_loss(log_probs, old, advantages, self.cfg.clip_ratio_low,
                                           self.cfg.clip_ratio_high, self.cfg.clip_ratio_dual)
            if "is_weights" in micro:  # one step off with algorithm.tis_cap: truncated importance weights
                token_loss = token_loss * micro["is_weights"].to(self.device)
            loss = aggregate(token_loss, mask, mode, scale)
            if algo.use_kl_loss and "ref_log_probs" in micro:
                kl = kl_penalty(log_probs, micro["ref_log_probs"].to(self.device), algo.kl_penalty)
                loss = loss + kl_coef * aggregate(kl, mask, mode, scale)
                sums["actor/kl_loss_sum"] += float(masked_sum(kl.detach(), mask))
            strategy.backward(loss)
            with torch.no_grad():
                sums["actor/pg_loss_sum"] += float(masked_sum(token_loss, mask))
                sums["actor/clipfrac_sum"] += float(masked_sum(info["clipped"], mask))
                sums["actor/dual_clipfrac_sum"] += float(masked_sum(info["dual_clipped"], mask))
                sums["actor/ppo_kl_sum"] += float(masked_sum(-info["log_ratio"], mask))
                sums["actor/entropy_sum"] += float(masked_sum(entropy, mask))  # type: ignore[arg-type]
                sums["actor/tokens"] += float(mask.sum())
        sums["actor/lr"] = strategy.lr  # the rate this step applies (the schedule advances in step())
        sums["actor/grad_norm_sum"] += strategy.step()
        sums["actor/optimizer_steps"] += 1
        return dict(sums)

    @dispatch(Dispatch.BROADCAST)
    def save_checkpoint(self, folder: str, background: bool = False) -> dict[str, float]:
        """Every rank writes its shards of the model and optimizer into ``folder`` (DCP), plus its RNG, within
        ``trainer.checkpoint_host_buffer_gb`` of host memory. ``background``: return once a host copy is staged
        and write it in a thread (:meth:`checkpoint_written`, :meth:`wait_checkpoint`). Seconds this call took."""
        self._end_background_save()  # the driver waits first; a second write must never overlap the first
        start = time.perf_counter()
        self.background_save = self.strategy.save(  # type: ignore[union-attr]
            Path(folder), self.rank, buffer_bytes=self.checkpoint_buffer_bytes(), background=background)
        return {"call_s": time.perf_counter() - start}

    def checkpoint_buffer_bytes(self) -> int:
        """trainer.checkpoint_host_buffer_gb in bytes (-1: sized from this node's RAM and its worker processes)."""
        from easytrain.memory.readings import node_ram

        t = self.config.trainer
        limit = self.config.watchdog.ram_limit_gb
        ram = node_ram(int(limit * 2**30) if limit else None)["ram_limit_bytes"]
        return host_buffer_bytes(t.checkpoint_host_buffer_gb, ram, t.workers_per_node)

    @dispatch(Dispatch.BROADCAST)
    def checkpoint_files(self, folder: str) -> dict[str, Any]:
        """What this rank sees of a written checkpoint: every file under ``folder`` (relative path -> bytes), with
        its rank and node, for the driver to check that it sees them too before it publishes."""
        import ray

        root = Path(folder)
        files = {str(f.relative_to(root)): f.stat().st_size for f in root.rglob("*") if f.is_file()}
        return {"rank": self.rank, "node_ip": ray.util.get_node_ip_address(), "files": files}

    @dispatch(Dispatch.BROADCAST)
    def checkpoint_written(self) -> bool:
        """Whether this rank has no background write in flight (finished or failed: :meth:`wait_checkpoint` says)."""
        return self.background_save is None or self.background_save.done()

    @dispatch(Dispatch.BROADCAST)
    def wait_checkpoint(self) -> dict[str, float]:
        """Block until this rank's background write is done: its write seconds and staged host GB ({} when there was
        none). Raises the write's error, so the driver never publishes a checkpoint a rank failed to write."""
        return self._end_background_save()

    def _end_background_save(self) -> dict[str, float]:
        pending, self.background_save = self.background_save, None
        return pending.wait() if pending is not None else {}

    @dispatch(Dispatch.RANK0)
    def load_checkpoint(self, folder: str) -> dict[str, Any]:
        """Load a training state saved by any number of ranks (DCP reshards to this group)."""
        self._end_background_save()  # a background write's thread still runs collectives: let it end first
        info = self.strategy.load(Path(folder), self.rank)  # type: ignore[union-attr]
        if not info.get("rng_restored", True):
            logger.info("actor rank %d: no RNG state saved for this rank (saved by %d ranks); keeping its seed",
                        self.rank, info["saved_ranks"])
        return info

    @dispatch(Dispatch.RANK0)
    def push_weights(self, targets: list[Any], bucket_bytes: int) -> dict[str, float]:
        """Stream the current weights to the rollout workers in buckets (see weight_sync); the frozen ones once
        (separate pools' engines never sleep, so they keep them)."""
        out = push_weights(self.model, self.rank, targets, bucket_bytes, self.lora_scale, self.frozen_pushed)
        self.frozen_pushed = True
        return out

    @property
    def lora_scale(self) -> float:
        lora = self.config.model.lora
        return lora.alpha / lora.rank if lora.rank else 1.0
