"""Issue 23: with ZeRO-3 the actor is built partitioned across the ranks (``deepspeed.zero.Init`` through
transformers), never whole in every process first, and holds exactly the checkpoint's weights; a reference
model built afterwards in the same process is an ordinary one. Two spawned CPU ranks over gloo, the worker's own
``build_sharded_model``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from test_deepspeed import spawn

pytestmark = pytest.mark.slow

OVERRIDES = ["+exp=tiny_sft", "worker.actor.strategy=deepspeed", "worker.actor.deepspeed.zero_stage=3"]


def _build_and_step(rank: int, world: int, out: Path) -> None:
    import deepspeed

    from easytrain.config import load
    from easytrain.distributed.deepspeed import parameter_count
    from easytrain.workers.base import build_strategy
    from easytrain.models.hf import load_model, model_folder
    from easytrain.workers.base import build_sharded_model

    config = load(OVERRIDES)
    folder = str(model_folder(config.model))
    cpu = torch.device("cpu")
    model = build_sharded_model(config, config.worker.actor, folder, cpu, world, trainable=True, shard=False)
    params = dict(model.named_parameters())
    record: dict[str, Any] = {
        "partitioned": all(hasattr(p, "ds_id") and p.numel() == 0 for p in params.values()),
        "local": sum(p.ds_tensor.numel() for p in params.values()),
        "total": sum(map(parameter_count, params.values())),
    }
    whole = load_model(config.model, folder, dtype="float32")  # as a reference model in the same process loads
    record["reference_whole"] = not any(hasattr(p, "ds_id") for p in whole.parameters())
    checkpoint = whole.state_dict()
    strategy = build_strategy(model, config.worker.actor, 4, compute_dtype="float32")
    worst = 0.0
    for name, param in params.items():
        with deepspeed.zero.GatheredParameters([param]):
            worst = max(worst, (param.detach() - checkpoint[name]).abs().max().item())
    record["max_difference"] = worst
    ids = torch.randint(8, 200, (2, 12), generator=torch.Generator().manual_seed(rank))
    loss = strategy.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                          mm_token_type_ids=torch.zeros_like(ids)).loss
    strategy.backward(loss)
    record["grad_norm"] = strategy.step()
    torch.save(record, out / f"rank{rank}.pt")


def test_zero3_builds_the_actor_partitioned_with_the_checkpoints_weights(tmp_path: Path) -> None:
    spawn(_build_and_step, tmp_path)
    records = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for record in records:
        assert record["partitioned"]  # every parameter a ZeRO-3 partition from construction on
        assert record["local"] <= record["total"] // 2 + 4096  # this rank's half (each tensor padded to even)
        assert record["reference_whole"]  # the context ends with the actor's build
        assert record["max_difference"] == 0.0  # gathered, exactly the checkpoint's weights
        assert 0.0 < record["grad_norm"] < float("inf")  # and it trains
    assert records[0]["total"] == records[1]["total"]
