"""Rollout engines side by side (HF generate vs vLLM), and weight-sync bandwidth against memcpy.

    .venv/bin/python bench/rollout.py            # -> bench/results/rollout.json

Generation: the same tiny Qwen2 text model (sizes tiny and small from the
tiny-model factory) and the same batch (16 prompts of the synthetic text task
x 4 samples, up to 32 new tokens, temperature 1, log-probs returned), each
engine in its own Ray worker with one CPU, run alternately ``--repeats``
times. Tokens/s = generated tokens / the worker's time inside ``generate``
(the engines' own speed; the Ray call around it is the same for both).

Weight sync: a randomly initialised Qwen2 of ~100M parameters (built here,
fp32) on a 2-rank FSDP2 actor streams its weights into a vLLM rollout worker
through the bucketed transport (each rank's shards -> object store -> joined
in the rollout worker -> vLLM layer-wise reload). Bandwidth = model bytes / sync wall time; it is set against this
machine's memcpy bandwidth (a 512 MB tensor copy) measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EASYTRAIN_DEBUG_METHODS", "1")  # the workers' busy_times (easytrain.workers.debug)

from bench.provenance import write_result  # noqa: E402

BATCH = ["data.synthetic_size=64", "data.rollout_batch_size=16", "worker.rollout.n=4",
         "data.max_response_length=32", "worker.actor.global_batch_size=16",
         "worker.actor.micro_batch_size_per_device_for_update=8", "data.max_prompt_length=128"]
TEXT = ["+exp=tiny_vllm", "data.image_key=null"]
"""The vLLM preset on a text model (the text form of the colour question), as these figures were measured."""


def memcpy_gb_per_s(megabytes: int = 512, repeats: int = 5) -> float:
    import torch

    from bench.weight_sync import memcpy_bandwidth

    return memcpy_bandwidth(megabytes * 2**20, repeats, torch.get_num_threads()) / 1e9


def build_sync_model(base: Path, out: Path, hidden: int, layers: int) -> Path:
    """A random Qwen2 with the tiny tokenizer, large enough that a sync moves real bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shutil.copytree(base, out, dirs_exist_ok=True)
    config = AutoConfig.from_pretrained(base)
    config.hidden_size, config.num_hidden_layers = hidden, layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * layers
    config.intermediate_size = hidden * 3
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = hidden // 64, hidden // 256, 64
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def generation(size: str, repeats: int, out_dir: str) -> dict[str, Any]:
    from easytrain.config import load
    from easytrain.distributed.group import WorkerGroup
    from easytrain.distributed.resources import ResourcePool
    from easytrain.trainer.data import RLData
    from easytrain.workers.rollout.worker import RolloutWorker

    results: dict[str, Any] = {}
    groups, pools = {}, []
    for engine in ("hf", "vllm"):
        config = load([f"trainer.output_dir={out_dir}", *TEXT, "model.path=tiny:qwen2", f"model.tiny_size={size}", *BATCH,
                       f"worker.rollout.engine={engine}"])
        pool = ResourcePool(f"bench-{engine}", 1, 1, "cpu")
        pools.append(pool)
        groups[engine] = WorkerGroup(RolloutWorker, f"rollout-{engine}", pool, num_cpus=1, num_gpus=0,
                                     init_args=(config,))
        groups[engine].call("setup")
    prompts = next(RLData(config).train_batches())
    for group in groups.values():
        group.call("generate", prompts, 0)  # warm-up (vLLM compiles its sampler on first use)
    runs: dict[str, list[dict[str, float]]] = {e: [] for e in groups}
    for step in range(repeats):
        for engine, group in groups.items():
            group.call("busy_times")
            start = time.perf_counter()
            out = group.call("generate", prompts, step + 1)
            wall = time.perf_counter() - start
            busy = group.call("busy_times")[0]["generate"]
            tokens = float(out["response_mask"].sum())
            runs[engine].append({"tokens": tokens, "worker_s": busy, "wall_s": wall})
    for engine, records in runs.items():
        results[engine] = {
            "median_worker_s": round(statistics.median(r["worker_s"] for r in records), 4),
            "median_tokens_per_s": round(statistics.median(r["tokens"] / r["worker_s"] for r in records), 1),
            "median_wall_tokens_per_s": round(statistics.median(r["tokens"] / r["wall_s"] for r in records), 1),
            "runs": records}
    results["vllm_over_hf"] = round(results["vllm"]["median_tokens_per_s"] / results["hf"]["median_tokens_per_s"], 2)
    for group in groups.values():
        group.shutdown()
    for pool in pools:
        pool.release()
    return results


def weight_sync(hidden: int, layers: int, bucket_mb: float, repeats: int, out_dir: str) -> dict[str, Any]:
    from easytrain.config import load
    from easytrain.distributed.group import WorkerGroup
    from easytrain.distributed.resources import ResourcePool
    from easytrain.models.tiny import build_tiny
    from easytrain.workers.actor import ActorWorker
    from easytrain.workers.rollout.worker import RolloutWorker
    from easytrain.workers.weight_sync import BucketedTransport

    folder = build_sync_model(build_tiny("qwen2", "tiny"), Path(out_dir) / "sync-model", hidden, layers)
    config = load([f"trainer.output_dir={out_dir}", *TEXT, f"model.path={folder}", *BATCH,
                   "data.max_prompt_length=64", "data.max_response_length=8"])
    actor_pool, rollout_pool = ResourcePool("bench-actor", 1, 2, "cpu"), ResourcePool("bench-rollout", 1, 1, "cpu")
    actor = WorkerGroup(ActorWorker, "actor", actor_pool, num_cpus=1, num_gpus=0, init_args=(config,))
    rollout = WorkerGroup(RolloutWorker, "rollout", rollout_pool, num_cpus=1, num_gpus=0, init_args=(config,))
    actor.init_process_group()
    sizes = actor.call("setup", 1)
    rollout.call("setup")
    transport = BucketedTransport(bucket_mb)
    records = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        synced = transport.sync(actor, rollout)
        synced["wall_s"] = time.perf_counter() - start
        records.append(synced)
    records = records[1:]  # the first sync pays one-off set-up
    model_bytes = records[0]["sync/model_mb"] * 2**20
    median_s = statistics.median(r["wall_s"] for r in records)
    for group in (actor, rollout):
        group.shutdown()
    for pool in (actor_pool, rollout_pool):
        pool.release()
    return {"parameters": sizes[0]["total"], "model_mb": round(model_bytes / 2**20, 1), "bucket_mb": bucket_mb,
            "buckets": records[0]["sync/buckets"], "median_sync_s": round(median_s, 3),
            "gb_per_s": round(model_bytes / median_s / 1e9, 3),
            "assembled_peak_mb": round(max(r["sync/assembled_peak_mb"] for r in records), 1),
            "median_split_s": {part: round(statistics.median(r[f"sync/{part}_s"] for r in records), 3)
                               for part in ("put", "wait")},
            "runs": records}


def kept_from(previous: dict[str, Any]) -> dict[str, Any]:
    """Commit and date of the results file a part is kept from (``--only`` re-measures the other part)."""
    return {"commit": previous.get("commit"), "date": previous.get("date", previous.get("measured"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sync-hidden", type=int, default=1024)
    parser.add_argument("--sync-layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--only", choices=["generation", "sync"], default=None,
                        help="re-measure one part and keep the other from the existing results file")
    args = parser.parse_args()

    import ray

    from easytrain.config.schema import RayConfig
    from easytrain.distributed.cluster import init_ray

    out_dir = tempfile.mkdtemp(prefix="easytrain-rollout-bench-")
    path = ROOT / "bench" / "results" / "rollout.json"
    previous = json.loads(path.read_text()) if args.only and path.exists() else {}
    init_ray(RayConfig(num_cpus=8))  # logical CPUs: actor, rollout and engine workers coexist on 2 cores
    summary: dict[str, Any] = {
        "benchmark": "rollout",
        "settings": {"prompts": 16, "n": 4, "max_new_tokens": 32, "temperature": 1.0, "dtype": "float32",
                     "workers_per_engine": 1, "repeats": args.repeats, "sync_hidden": args.sync_hidden,
                     "sync_layers": args.sync_layers, "bucket_mb": args.bucket_mb},
    }
    if args.only == "sync":
        summary["generation"] = previous["generation"]
        summary["generation_measured"] = previous.get("generation_measured") or kept_from(previous)
    else:
        summary["generation"] = {size: generation(size, args.repeats, out_dir) for size in ("tiny", "small")}
    summary["memcpy_gb_per_s"] = round(memcpy_gb_per_s(), 2)
    if args.only == "generation":
        summary["weight_sync"] = previous["weight_sync"]
        summary["weight_sync_measured"] = previous.get("weight_sync_measured") or kept_from(previous)
    else:
        summary["weight_sync"] = weight_sync(args.sync_hidden, args.sync_layers, args.bucket_mb, args.repeats,
                                             out_dir)
    sync = summary["weight_sync"]
    sync["fraction_of_memcpy"] = round(sync["gb_per_s"] / summary["memcpy_gb_per_s"], 3)
    ray.shutdown()
    write_result(path, summary)
    for size, result in summary["generation"].items():
        print(f"generation ({size} qwen2): HF {result['hf']['median_tokens_per_s']} tok/s, "
              f"vLLM {result['vllm']['median_tokens_per_s']} tok/s ({result['vllm_over_hf']}x)")
    print(f"weight sync: {sync['model_mb']} MB ({sync['parameters']} parameters) in {sync['median_sync_s']} s = "
          f"{sync['gb_per_s']} GB/s; memcpy {summary['memcpy_gb_per_s']} GB/s -> "
          f"{100 * sync['fraction_of_memcpy']:.1f}% of memcpy; assembled peak {sync['assembled_peak_mb']} MB "
          f"with {sync['bucket_mb']} MB buckets")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
