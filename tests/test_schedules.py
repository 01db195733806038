"""Learning-rate schedules against their closed forms, read from the optimizer the strategy really steps.

For optimizer step k (0-based), warm-up W, total T and peak lr:

    k < W:     lr * (k + 1) / W
    constant:  lr
    linear:    lr * (1 - (k - W) / (T - W))
    cosine:    lr * 0.5 * (1 + cos(pi * (k - W) / (T - W)))

The lr of step k is the one in the optimizer's param group at the moment ``strategy.step()`` calls
``optimizer.step()`` (a step pre-hook on the strategy's own torch AdamW records it). FSDP2's strategy runs
in this process; DeepSpeed's in one spawned gloo rank (``deepspeed.initialize`` needs a process group).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from easytrain.config.schema import ActorConfig
from easytrain.distributed.strategy import TrainStrategy
from easytrain.workers.base import build_strategy

from reference import lr_at
from rendezvous import rendezvous

PEAK_LR = 3e-3
WARMUP = 3
TOTAL = 10
KINDS = ("constant", "linear", "cosine")


def expected_lr(k: int, kind: str, warmup: int = WARMUP, total: int = TOTAL, lr: float = PEAK_LR) -> float:
    return lr_at(k, kind, warmup, total, lr)


def actor_config(kind: str, warmup: int = WARMUP, strategy: str = "fsdp") -> ActorConfig:
    cfg = ActorConfig()
    cfg.strategy = strategy
    cfg.deepspeed.zero_stage = 2
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.scheduler = PEAK_LR, warmup, kind
    cfg.optim.weight_decay = 0.0
    return cfg


def lrs_used(strategy: TrainStrategy, optimizer: torch.optim.Optimizer, steps: int) -> tuple[list[float], list[float]]:
    """Take ``steps`` optimizer steps on a real gradient; the lr each ``optimizer.step()`` ran with, and
    ``strategy.lr`` after each step."""
    used: list[float] = []
    handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    after: list[float] = []
    inputs = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(steps):
            strategy.zero_grad()
            strategy.backward(strategy.model(inputs).square().sum())
            strategy.step()
            after.append(strategy.lr)
    finally:
        handle.remove()
    assert len(used) == steps, "one optimizer step per strategy step"
    return used, after


def fsdp_lrs(kind: str, warmup: int = WARMUP) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    strategy = build_strategy(nn.Linear(3, 2), actor_config(kind, warmup), TOTAL)
    return lrs_used(strategy, strategy.optimizer, TOTAL)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_strategy_steps_with_the_closed_form_schedule(kind: str) -> None:
    used, after = fsdp_lrs(kind)
    assert used == pytest.approx([expected_lr(k, kind) for k in range(TOTAL)], rel=1e-12, abs=1e-15)
    # strategy.lr, read after step k, is the lr step k + 1 will use
    assert after[:-1] == pytest.approx(used[1:], rel=1e-12, abs=1e-15)


def test_warmup_ramps_linearly_to_the_peak_over_its_steps() -> None:
    used, _ = fsdp_lrs("constant")
    assert used[:WARMUP + 1] == pytest.approx([PEAK_LR / 3, 2 * PEAK_LR / 3, PEAK_LR, PEAK_LR])


def test_without_warmup_decay_starts_at_the_peak() -> None:
    used, _ = fsdp_lrs("linear", warmup=0)
    assert used == pytest.approx([expected_lr(k, "linear", warmup=0) for k in range(TOTAL)])
    assert used[0] == pytest.approx(PEAK_LR) and used[-1] == pytest.approx(PEAK_LR / TOTAL)


# ----------------------------------------------------------------------------- DeepSpeed (one spawned rank)


def _deepspeed_job(rank: int, init_method: str, out: str) -> None:
    import logging
    import os

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        strategy: Any = build_strategy(nn.Linear(3, 2), actor_config("cosine", strategy="deepspeed"), TOTAL)
        torch.save(lrs_used(strategy, strategy.optimizer, TOTAL), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_deepspeed_strategy_steps_with_warmup_then_cosine(tmp_path: Path) -> None:
    """The DeepSpeed engine steps the strategy's own AdamW with the lr the schedule set (one kind: the schedule
    code is the FSDP one's, tested above; this checks the engine's step runs with it)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "lrs.pt"
    mp.spawn(_deepspeed_job, args=(rendezvous(tmp_path), str(out)), nprocs=1, join=True)
    used, after = torch.load(out)
    assert used == pytest.approx([expected_lr(k, "cosine") for k in range(TOTAL)], rel=1e-12, abs=1e-15)
    assert after[:-1] == pytest.approx(used[1:], rel=1e-12, abs=1e-15)

