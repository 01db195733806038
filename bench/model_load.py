"""Peak host RAM while a 2-rank FSDP2 actor loads a ~100M-parameter model, as a multiple of one fp32 model copy.

    .venv/bin/python bench/model_load.py                 # -> bench/results/model_load.json
    .venv/bin/python bench/model_load.py --trials 1      # quicker

Two ways, each in fresh Ray actor processes (local Ray, one node, 2 ranks, gloo):

- "every rank loads the full model (before issue 22)": the old procedure, run explicitly here: each rank
  ``from_pretrained`` in fp32, the same preparation (cache off, image dedup, frozen parts, activation
  checkpointing), then ``fully_shard``;
- "rank 0 loads, the others receive their shards": ``ActorWorker.setup`` as it is now (easytrain/distributed/
  load.py: rank 0 reads the checkpoint, rank 1 builds on the meta device and receives its shards by broadcast).

Per rank: the peak RSS during the load (the kernel's VmHWM, reset just before it starts) minus the process's RSS
just before it (imports already done), divided by one fp32 copy (parameters x 4 bytes); summed over the ranks
for the node. The median over ``--trials`` is reported, every trial is kept in the file.

Measured (2 CPU cores, 103.6M parameters, one fp32 copy 395 MiB, median of 3 trials), in model copies:

    bf16 checkpoint loaded in fp32 (as real Qwen checkpoints ship):
      every rank loads the full model (before issue 22):   rank 0 1.52, rank 1 1.52, summed 3.04
      rank 0 loads, the others receive their shards:       rank 0 1.53, rank 1 0.61, summed 2.15
    fp32 checkpoint loaded in fp32:
      every rank loads the full model (before issue 22):   rank 0 1.16, rank 1 1.12, summed 2.28
      rank 0 loads, the others receive their shards:       rank 0 1.53, rank 1 0.61, summed 2.14

Rank 0 holds the loaded copy and its own shard until the broadcast ends; every other rank its shard plus the
tensor in flight. With N ranks a node holds about 2 copies at the peak instead of N + 1 (bf16 checkpoint). An
fp32 checkpoint cost the old way less: loading it into fp32 converts nothing, the weights stay in the
memory-mapped file (shared page cache) and each rank touched only the pages of its own shard, while rank 0's
broadcast now reads every page.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402

OLD = "every rank loads the full model (before issue 22)"
NEW = "rank 0 loads, the others receive their shards"
SPEC = dict(hidden=1024, layers=7, heads=8, kv_heads=2, intermediate=3840,
            vision_depth=4, vision_hidden=128, vision_heads=2, vision_intermediate=256)
"""~104M parameters: the tiny factory's Qwen2.5-VL with wider, deeper text layers (its own sizes are ~0.2M, ~4M)."""
CHECKPOINT_DTYPES = ("bfloat16", "float32")
"""Real checkpoints ship in bf16: loading them in fp32 converts, so each loading process holds a copy of its own.
An fp32 checkpoint loads into fp32 from the memory-mapped file, whose pages a process touches only where it
reads: the old way then copies just its shard out of the mapping, and the mapped pages are shared page cache."""


def build_model(cache: Path, dtype: str) -> Path:
    """The tiny factory's Qwen2.5-VL at SPEC's shapes, saved with ``save_pretrained`` (fp32), and for ``bfloat16``
    a copy of that folder whose weights file holds the same tensors in bf16 (as real Qwen checkpoints ship)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from easytrain.models import tiny

    with mock.patch.dict(tiny.SPECS, {"bench-100m": tiny.TinySpec(**SPEC)}):
        folder = tiny.build_tiny("qwen2_5_vl", "bench-100m", 0, cache)
    if dtype == "float32":
        return folder
    target = cache / f"{folder.name}-{dtype}"
    if not target.exists():
        shutil.copytree(folder, target)
        weights = load_file(str(folder / "model.safetensors"))
        save_file({k: v.to(getattr(torch, dtype)) for k, v in weights.items()}, str(target / "model.safetensors"),
                  metadata={"format": "pt"})
    return target


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _reset_peak() -> str:
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; the source the peak will be read from."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return "VmHWM"
    except OSError:  # not Linux, or not allowed: the process's lifetime peak (valid if the load sets it)
        return "ru_maxrss"


def _peak(source: str) -> int:
    if source == "VmHWM":
        found = re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())
        assert found is not None
        return int(found.group(1)) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _make_worker_class() -> type:
    from easytrain.distributed.group import Dispatch, dispatch
    from easytrain.workers.actor import ActorWorker

    class LoadBench(ActorWorker):
        """The actor with its load measured, by either procedure."""

        @dispatch(Dispatch.BROADCAST)
        def measure(self, way: str) -> dict[str, Any]:
            from easytrain.models.hf import family
            from easytrain.models.tiny import model_class_for

            model_class_for(family(self.folder).model_type)  # imports before measuring
            gc.collect()
            before = _rss()
            source = _reset_peak()
            start = time.perf_counter()
            if way == NEW:
                self.setup(1)
            else:
                self.model = self._old_load()
            seconds = time.perf_counter() - start
            return {"rank": self.rank, "rss_before_bytes": before, "peak_rss_bytes": _peak(source),
                    "peak_source": source, "seconds": seconds}

        def _old_load(self) -> Any:
            """build_sharded_model before issue 22 (fp32 compute, full sharding): the full model on every rank."""
            from easytrain.distributed.fsdp import apply_activation_checkpointing, apply_fsdp, build_mesh
            from easytrain.models.hf import load_model
            from easytrain.models.image_dedup import dedupe_images
            from easytrain.models.parts import freeze_parts

            model_cfg = self.config.model
            model = load_model(model_cfg, self.folder, dtype="float32")
            model.config.use_cache = False
            if model_cfg.dedupe_images:
                dedupe_images(model)
            freeze_parts(model, model_cfg.freeze_vision_tower, model_cfg.freeze_aligner, model_cfg.freeze_llm)
            if model_cfg.gradient_checkpointing:
                apply_activation_checkpointing(model)
            mesh = build_mesh(self.device.type, self.world_size, self.cfg.fsdp.shard_size)
            apply_fsdp(model, mesh=mesh, reshard_after_forward=self.cfg.fsdp.full_shard, offload_params=False,
                       param_dtype=None, reduce_dtype=None, device_type=self.device.type)
            return model

    return LoadBench


def run_once(config: Any, way: str, name: str) -> list[dict[str, Any]]:
    """One load by ``way`` in a fresh 2-rank group; per-rank readings."""
    from easytrain.distributed.group import WorkerGroup
    from easytrain.distributed.resources import ResourcePool

    pool = ResourcePool(name, 1, 2, "cpu")
    group = WorkerGroup(_make_worker_class(), "actor", pool, num_cpus=1, num_gpus=0, init_args=(config,))
    try:
        group.init_process_group()
        return sorted(group.call("measure", way), key=lambda r: r["rank"])
    finally:
        group.shutdown()
        pool.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "model_load.json")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from easytrain.config import load
    from easytrain.models.tiny import count_parameters

    work = Path(tempfile.mkdtemp(prefix="easytrain-load-bench-"))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="easytrain-bench")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    params, results = 0, {}
    try:
        for dtype in CHECKPOINT_DTYPES:
            folder = build_model(work / "cache", dtype)
            params = count_parameters(folder)
            config = load([f"trainer.output_dir={work / 'out'}", f"model.path={folder}", "data.num_workers=0"])
            trials: dict[str, list[list[dict[str, Any]]]] = {OLD: [], NEW: []}
            for trial in range(args.trials):
                for i, way in enumerate((OLD, NEW)):
                    trials[way].append(run_once(config, way, f"load-bench-{dtype}-{trial}-{i}"))
            results[dtype] = summarise(trials, 4 * params)
    finally:
        ray.shutdown()

    copy = 4 * params
    summary = {
        "benchmark": "model_load",
        "settings": {"model": "tiny-factory qwen2_5_vl " + ", ".join(f"{k}={v}" for k, v in SPEC.items()),
                     "parameters": params, "model_copy_bytes": copy, "ranks": 2, "load_dtype": "float32",
                     "strategy": "fsdp (full shard, no offload)", "trials": args.trials,
                     "measure": "peak RSS during the load (VmHWM reset just before) minus RSS just before, "
                                "divided by parameters x 4 bytes; median over trials"},
        "checkpoints": results,
    }
    write_result(args.out, summary)
    print(f"{params / 1e6:.1f}M parameters, one fp32 copy {copy / 2**20:.0f} MiB; peak RSS above pre-load, "
          f"in model copies (median of {args.trials}):")
    for dtype, ways in results.items():
        print(f" {dtype} checkpoint loaded in fp32:")
        for way, figures in ways.items():
            ranks = ", ".join(f"rank {i} {c:.2f}" for i, c in enumerate(figures["peak_above_pre_load_copies_per_rank"]))
            print(f"  {way + ':':<52} {ranks}, summed {figures['peak_above_pre_load_copies_summed']:.2f}  "
                  f"(load {max(figures['load_seconds_per_rank']):.1f} s)")
    print(f"wrote {args.out}")


def summarise(trials: dict[str, list[list[dict[str, Any]]]], copy: int) -> dict[str, Any]:
    """Per way: the median per rank and summed over the ranks, in model copies, and every trial's readings."""
    def copies(reading: dict[str, Any]) -> float:
        return (reading["peak_rss_bytes"] - reading["rss_before_bytes"]) / copy

    ways = {}
    for way, runs in trials.items():
        ways[way] = {
            "peak_above_pre_load_copies_per_rank": [round(statistics.median(copies(run[rank]) for run in runs), 3)
                                                    for rank in range(2)],
            "peak_above_pre_load_copies_summed": round(statistics.median(sum(map(copies, run)) for run in runs), 3),
            "load_seconds_per_rank": [round(statistics.median(run[rank]["seconds"] for run in runs), 2)
                                      for rank in range(2)],
            "trials": [[{**r, "copies": round(copies(r), 3)} for r in run] for run in runs],
        }
    return ways


if __name__ == "__main__":
    main()
