"""How a training role holds its model and takes optimizer steps: one interface, two strategies.

:class:`TrainStrategy` is what the actor's loops talk to: call forward on
``strategy.model``, ``backward(loss)`` for each micro batch, ``step()`` at the
end of an optimizer step (clip, step if the norm is finite, schedule, zero),
``save``/``load`` for checkpoints. :class:`FSDPStrategy` (FSDP2, the default)
lives here; the DeepSpeed ZeRO one in :mod:`easytrain.distributed.deepspeed`
(``worker.actor.strategy``).

Gradients are averaged over the data-parallel ranks by both strategies; the
callers' losses are normalised for that (see ``workers/actor.py``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from easytrain.config.schema import ActorConfig, OptimConfig

if TYPE_CHECKING:
    from easytrain.distributed.checkpoint import BackgroundSave

logger = logging.getLogger(__name__)


def lr_lambda(warmup: int, total: int, kind: str) -> Callable[[int], float]:
    """Linear warm-up, then constant, cosine or linear decay to zero at ``total`` optimizer steps."""
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
    return factor


def build_optimizer(params: list[nn.Parameter], optim: OptimConfig,
                    total_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (plain torch, fp32 states) and its warm-up/decay schedule."""
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas),  # type: ignore[arg-type]
                                  weight_decay=optim.weight_decay, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim.warmup_steps, total_steps,
                                                                       optim.scheduler))
    return optimizer, scheduler


class TrainStrategy:
    """A trained model spread over the role's ranks, with its optimizer and LR schedule."""

    model: nn.Module
    """Call forward on this (every rank of the role, the same number of times)."""
    optimizer: torch.optim.Optimizer

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of ``loss`` (already scaled by the caller)."""
        raise NotImplementedError

    def step(self) -> float:
        """Clip by ``optim.max_grad_norm``, step when the norm is finite, advance the schedule, zero the
        gradients; returns the global gradient norm."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    @property
    def lr(self) -> float:
        raise NotImplementedError

    def save(self, folder: Path, rank: int, *, buffer_bytes: Optional[int] = None,
             background: bool = False) -> Optional[BackgroundSave]:
        """Every rank writes its shards of the training state into ``folder``, holding at most ``buffer_bytes`` of
        host memory beyond the step's (``trainer.checkpoint_host_buffer_gb``; None: 1 GiB). ``background``: return once a host
        copy is staged; the returned handle's ``wait()`` says when the shards are written."""
        raise NotImplementedError

    def load(self, folder: Path, rank: int) -> dict[str, Any]:
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights in the model's own names, on CPU; every rank must call it."""
        raise NotImplementedError

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def optimizer_state_devices(self) -> list[str]:
        """The device types the optimizer's tensor states live on (debug: where offload put them)."""
        states = [v for state in self.optimizer.state.values() for v in state.values()
                  if torch.is_tensor(v) and v.dim() > 0]
        return sorted({t.device.type for t in states})


class FSDPStrategy(TrainStrategy):
    """FSDP2 shards (built by ``workers.base.build_sharded_model``), torch AdamW, DCP checkpoints."""

    def __init__(self, model: nn.Module, cfg: ActorConfig, total_steps: int) -> None:
        self.model, self.cfg = model, cfg
        self.optimizer, self.scheduler = build_optimizer(self.trainable(), cfg.optim, total_steps)
        self._background_group: Optional[dist.ProcessGroup] = None

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        max_norm = self.cfg.optim.max_grad_norm or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.trainable(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if torch.isfinite(norm):
            self.optimizer.step()
        else:
            logger.warning("actor: non-finite gradient norm %s, optimizer step skipped", float(norm))
        self.scheduler.step()
        self.zero_grad()
        return float(norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def save(self, folder: Path, rank: int, *, buffer_bytes: Optional[int] = None,
             background: bool = False) -> Optional[BackgroundSave]:
        from easytrain.distributed.checkpoint import save_training_state

        return save_training_state(folder, self.model, self.optimizer, self.scheduler, rank, buffer_bytes=buffer_bytes,
                                   background=background, process_group=self.background_group() if background else None)

    def background_group(self) -> Optional[dist.ProcessGroup]:
        """A gloo group of the same ranks for background saves: their collectives (DCP's planning and commit) run in
        a thread while the step's run on the default group. Made at the first background save (collective)."""
        if not dist.is_initialized():
            return None
        if self._background_group is None:
            self._background_group = dist.new_group(backend="gloo")
        return self._background_group

    def load(self, folder: Path, rank: int) -> dict[str, Any]:
        from easytrain.distributed.checkpoint import load_training_state

        return load_training_state(folder, self.model, self.optimizer, self.scheduler, rank)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
