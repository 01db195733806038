"""Weight-sync bandwidth of a ~100M-parameter model, as a fraction of this machine's memcpy bandwidth.

    .venv/bin/python bench/weight_sync.py              # -> bench/results/weight_sync.json
    .venv/bin/python bench/weight_sync.py --repeats 3  # quicker

Both paths sync the same model (bench/model_load.py's 103.6M-parameter Qwen2.5-VL, fp32) from a 2-rank
FSDP2 actor into 2 HF rollout engines, on local Ray, CPU:

- ``in_process`` (fused workers, ``trainer.colocate=true``, the default): each process gathers the actor's
  shards bucket by bucket (gloo all-gather) into full tensors and copies them into its own engine;
- ``object_store`` (the path before issue 22, still the one for ``trainer.colocate=false``): each actor rank
  puts its shards of a bucket in Ray's object store, each rollout process joins the parts and loads them.

A sync delivers one full model into every engine, so its bandwidth is ``engines x model bytes / seconds``
(the driver's wall time of ``transport.sync``, Ray calls included), set against ``memcpy``: the bandwidth of
``dst.copy_(src)`` over a buffer of the model's size in one process using all of this machine's cores (the
median of 9, measured before and after the runs; the larger counts). The sync's processes have one core each. ``memcpy_fraction`` is the in-process path's; the object-store path's is beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.model_load import build_model  # noqa: E402
from bench.provenance import write_result  # noqa: E402

PATHS = {"in_process": "trainer.colocate=true", "object_store": "trainer.colocate=false"}


def memcpy_bandwidth(nbytes: int, repeats: int, threads: int) -> float:
    """Bytes per second of one large ``copy_`` between two buffers of ``nbytes`` (pages touched first) with
    ``threads`` torch threads: the median of ``repeats``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    torch.set_num_threads(before)
    return nbytes / statistics.median(times)


def measure(folder: Path, layout: str, repeats: int, bucket_mb: float) -> dict[str, Any]:
    import ray

    from easytrain.config import load
    from easytrain.trainer.roles import build_roles

    out = tempfile.mkdtemp(prefix="easytrain-sync-bench-")
    config = load([f"trainer.output_dir={out}", f"model.path={folder}", "trainer.workers_per_node=2",
                   "algorithm.kl_coef=0", "data.num_workers=0", f"worker.rollout.sync_bucket_mb={bucket_mb}",
                   layout])
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    roles = build_roles(config, total_optimizer_steps=1)
    try:
        engines = roles.rollout.world_size
        roles.transport.sync(roles.actor, roles.rollout)  # warm-up: first buffers, first collectives
        seconds, reported = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            metrics = roles.transport.sync(roles.actor, roles.rollout)
            seconds.append(time.perf_counter() - start)
            reported.append(metrics)
        model_bytes = reported[0]["sync/model_mb"] * 2**20
    finally:
        roles.shutdown()
        ray.shutdown()
    median = statistics.median(seconds)
    return {"engines": engines, "model_bytes": int(model_bytes), "median_s": round(median, 4),
            "seconds": [round(s, 4) for s in seconds], "bytes_per_s": engines * model_bytes / median,
            "worker_metrics": reported[len(reported) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "weight_sync.json")
    args = parser.parse_args()

    from easytrain.models.tiny import count_parameters, default_cache_dir

    import os

    folder = build_model(default_cache_dir() / "bench", "float32")
    cores = len(os.sched_getaffinity(0))
    model_bytes = count_parameters(folder) * 4
    # the machine's copy bandwidth (all its cores), before and after the runs: the larger is the yardstick
    copies = [memcpy_bandwidth(model_bytes, 9, cores)]
    results = {name: measure(folder, layout, args.repeats, args.bucket_mb) for name, layout in PATHS.items()}
    copies.append(memcpy_bandwidth(model_bytes, 9, cores))
    memcpy, one_core = max(copies), memcpy_bandwidth(model_bytes, 9, 1)
    for result in results.values():
        result["memcpy_fraction"] = round(result["bytes_per_s"] / memcpy, 4)
        result["gb_per_s"] = round(result["bytes_per_s"] / 1e9, 3)
    summary = {
        "benchmark": "weight_sync",
        "settings": {"model": "bench/model_load.py's Qwen2.5-VL (fp32)", "parameters": count_parameters(folder),
                     "actor_ranks": 2, "engines": "hf, one per rank", "bucket_mb": args.bucket_mb,
                     "repeats": args.repeats},
        "memcpy_gb_per_s": round(memcpy / 1e9, 3),
        "memcpy_threads": cores,
        "memcpy_gb_per_s_before_after": [round(c / 1e9, 3) for c in copies],
        "memcpy_one_core_gb_per_s": round(one_core / 1e9, 3),
        "memcpy_fraction": results["in_process"]["memcpy_fraction"],
        "object_store_memcpy_fraction": results["object_store"]["memcpy_fraction"],
        "paths": results,
    }
    write_result(args.out, summary)
    print(f"memcpy {memcpy / 1e9:.2f} GB/s ({cores} threads; one core {one_core / 1e9:.2f}); model {model_bytes / 2**20:.0f} MiB to 2 engines")
    for name, result in results.items():
        print(f"  {name:<13} {result['median_s']:.3f} s per sync, {result['gb_per_s']:.2f} GB/s, "
              f"{100 * result['memcpy_fraction']:.1f}% of memcpy")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
