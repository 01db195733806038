"""Loading a 2-rank FSDP2 actor: rank 0 reads the checkpoint, rank 1 builds on the meta device and receives its
shards (easytrain/distributed/load.py), through the actor's real ``setup`` on Ray. The weights equal
``from_pretrained``'s bitwise, every buffer (the non-persistent rotary frequencies too) equals the plain model's
on both ranks, LoRA adapters are rank 0's on both ranks, and rank 1's peak RSS while loading stays below one
full fp32 copy above what it held before (the old path: at least one full copy on every rank)."""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import pytest
import torch

from easytrain.distributed.group import Dispatch, WorkerGroup, dispatch
from easytrain.distributed.resources import ResourcePool
from easytrain.workers.actor import ActorWorker

from grpo_helpers import make_config

pytestmark = pytest.mark.slow

SIZED = dict(hidden=1024, layers=4, heads=8, kv_heads=2, intermediate=4096,
             vision_depth=2, vision_hidden=128, vision_heads=2, vision_intermediate=256)
"""~62M parameters (~250 MB in fp32): one copy is well above the process's RSS noise while loading."""


def _hwm_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


class LoadProbe(ActorWorker):
    """The actor, plus its ``setup`` measured: RSS before, peak RSS during (VmHWM reset just before)."""

    @dispatch(Dispatch.BROADCAST)
    def measured_setup(self, total_optimizer_steps: int) -> dict[str, Any]:
        import psutil

        from easytrain.models.hf import family
        from easytrain.models.tiny import model_class_for

        model_class_for(family(self.folder).model_type)  # imports done before measuring: their RSS is not the load's
        if self.config.model.lora.rank:
            import peft  # noqa: F401
        gc.collect()
        before = psutil.Process().memory_info().rss
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak RSS) to the current RSS
        counts = self.setup(total_optimizer_steps)
        peak = _hwm_bytes()
        lora = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
                for name, p in self.model.named_parameters() if "lora_" in name}  # collective: same order
        buffers = {name: b.detach().cpu().clone() for name, b in self.model.named_buffers()}
        return {"rank": self.rank, "before": before, "peak": peak, "lora": lora, "buffers": buffers, **counts}


@pytest.fixture(scope="module")
def sized_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny-factory model with SIZED's shapes (the factory's sizes are ~0.2M and ~4M parameters), its weights
    file in bf16 as real checkpoints ship (loading it in fp32 converts: the old path held a copy per rank)."""
    from safetensors.torch import load_file, save_file

    from easytrain.models import tiny

    with mock.patch.dict(tiny.SPECS, {"load-test": tiny.TinySpec(**SIZED)}):
        folder = tiny.build_tiny("qwen2_5_vl", "load-test", 0, tmp_path_factory.mktemp("sized-cache"))
    weights = folder / "model.safetensors"
    save_file({k: v.bfloat16() for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def reference(sized_model: Path) -> Any:
    """``from_pretrained`` of the sized model in fp32: what every rank must end up with."""
    from easytrain.config import load
    from easytrain.models.hf import load_model

    config = load([f"model.path={sized_model}"])
    return load_model(config.model, str(sized_model), dtype="float32")


@pytest.fixture(scope="module", autouse=True)
def probe_importable(ray_clusters: Any) -> Iterator[None]:
    """Ray workers cannot import test modules; ship this one by value."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray_clusters.local()
    yield


VARIANTS = {
    "plain": (),
    "lora": ("model.lora.rank=4", "model.lora.alpha=8"),
    "offload": ("worker.actor.offload.params=true",),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_load_the_checkpoint_once(variant: str, sized_model: Path, reference: Any,
                                             tmp_path: Path) -> None:
    config = make_config(str(tmp_path), f"model.path={sized_model}", *VARIANTS[variant])
    pool = ResourcePool(f"load-{variant}", 1, 2, "cpu")
    group = WorkerGroup(LoadProbe, "actor", pool, num_cpus=1, num_gpus=0, init_args=(config,))
    try:
        group.init_process_group()
        ranks = sorted(group.call("measured_setup", 10), key=lambda r: r["rank"])
        state = group.call("full_state_dict")
        placement = group.call("placement")
    finally:
        group.shutdown()
        pool.release()

    expected = reference.state_dict()
    assert state.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(state[k], expected[k])] == []  # bitwise

    plain_buffers = dict(reference.named_buffers())
    assert any("inv_freq" in name for name in plain_buffers)  # non-persistent: not in the state dict
    for r in ranks:
        got = {name.removeprefix("base_model.model."): b for name, b in r["buffers"].items()}
        assert got.keys() == plain_buffers.keys()
        assert [n for n, b in plain_buffers.items() if not torch.equal(got[n], b)] == [], f"rank {r['rank']}"

    if variant == "lora":
        assert ranks[0]["lora"] and ranks[0]["lora"].keys() == ranks[1]["lora"].keys()
        assert all(torch.equal(a, ranks[1]["lora"][n]) for n, a in ranks[0]["lora"].items())  # rank 0's init
        assert any(bool(a.abs().sum()) for n, a in ranks[0]["lora"].items() if "lora_A" in n)
    else:
        assert not ranks[0]["lora"]
    if variant == "offload":
        assert {p["offload_policies"][0] for p in placement} == {"CPUOffloadPolicy"}
        assert all(p["param_devices"] == ["cpu"] for p in placement)

    copy = 4 * sum(p.numel() for p in reference.parameters())
    rank1 = (ranks[1]["peak"] - ranks[1]["before"]) / copy
    rank0 = (ranks[0]["peak"] - ranks[0]["before"]) / copy
    # Rank 1 holds its half of the shards plus one tensor in flight; the old path held a full fp32 copy plus its
    # shard on every rank (1.5 copies with a bf16 checkpoint: bench/model_load.py).
    assert rank1 < 1.0, f"rank 1 peaked at {rank1:.2f} model copies above its pre-load RSS (rank 0: {rank0:.2f})"
