"""One GRPO step, phase by phase: where the time goes, how much is orchestration, memory per role.

    .venv/bin/python bench/grpo_step.py                 # tiny model  -> bench/results/grpo_step_tiny.json
    .venv/bin/python bench/grpo_step.py --size small    # ~4M model   -> bench/results/grpo_step_small.json

Runs the real trainer (local Ray, 2 CPU devices, each a fused worker hosting
actor, reference and rollout; ``--override trainer.colocate=false`` for a
process per role; HF engine) on the synthetic image task: 8 prompts x 4 responses, 32 new
tokens, reference with a KL loss, fp32. After warm-up steps it measures
``--steps`` steps. Orchestration overhead is the step's wall time minus the
work: for each phase the slowest rank's time inside the worker method (each
worker records its own busy time), plus the time waiting for reward scores.
What is left is the driver's own work, Ray calls and (de)serialisation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EASYTRAIN_DEBUG_METHODS", "1")  # the workers' busy_times (easytrain.workers.debug)

from bench.provenance import write_result  # noqa: E402

PHASE_METHODS = {
    "generate": ["generate"], "sleep": ["sleep"], "ref": ["compute_ref_log_probs"],
    "old_log_probs": ["compute_log_probs"], "update": ["update"],
    # fused workers gather and load in-process; separate pools stream buckets (the rollout ranks load them)
    "sync": ["sync_weights", "push_weights"],
}
"""Each phase's worker methods: its work is the slowest process's time inside them."""


def measure(config: Any, steps: int, warmup: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``warmup + steps`` GRPO steps of the real trainer on ``config`` (Ray already up): per measured step its
    wall time, phases, each phase's worker busy time, orchestration, generated tokens and the step's metrics;
    and each role's memory readings at the end."""
    from easytrain.trainer.rl import RLTrainer

    trainer = RLTrainer(config)
    groups = trainer.roles.processes()  # each process once: the fused workers, or a group per role
    prompts = trainer.data.train_batches()
    records = []
    try:
        for step in range(warmup + steps):
            trainer.step = step + 1
            for group in groups.values():
                group.call("busy_times")  # reset
            metrics = trainer.train_step(prompts).metrics
            busy = [b for group in groups.values() for b in group.call("busy_times")]
            work = {phase: max(sum(b.get(method, 0.0) for method in methods) for b in busy)
                    for phase, methods in PHASE_METHODS.items() if f"time/{phase}" in metrics}  # phases it ran
            if step < warmup:
                continue
            compute = sum(work.values()) + metrics["time/reward"]
            records.append({"step_s": metrics["time/step"],
                            "phases_s": {k[5:]: v for k, v in metrics.items()
                                         if k.startswith("time/") and k != "time/step"},
                            "worker_busy_s": work, "orchestration_s": metrics["time/step"] - compute,
                            # one step off, a batch generates during the step before it: no generate phase
                            "generated_tokens": (metrics["perf/generate_tokens_per_s"] * metrics["time/generate"]
                                                 if "time/generate" in metrics else None),
                            "tokens_per_s": metrics.get("perf/generate_tokens_per_s"),
                            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
        memory = {name: group.call("memory") for name, group in groups.items()}
    finally:
        trainer.close()
    return records, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra config override (repeatable), e.g. model.dedupe_images=false")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default: bench/results/grpo_step_<size>.json)")
    args = parser.parse_args()

    import ray

    from easytrain.config import load
    from easytrain.distributed.cluster import init_ray

    out_dir = tempfile.mkdtemp(prefix="easytrain-grpo-bench-")
    config = load([f"trainer.output_dir={out_dir}", f"model.tiny_size={args.size}", "data.num_workers=0",
                   "data.rollout_batch_size=8", "worker.rollout.n=4", "data.max_response_length=32",
                   "worker.actor.global_batch_size=8", "algorithm.kl_coef=0.04", "trainer.loggers=[jsonl]",
                   "data.synthetic_size=128", f"trainer.max_steps={args.warmup + args.steps}",
                   *args.override])
    init_ray(config.ray)
    records, memory = measure(config, args.steps, args.warmup)
    ray.shutdown()

    median = statistics.median
    step_s = median(r["step_s"] for r in records)
    overhead = median(r["orchestration_s"] / r["step_s"] for r in records)
    summary = {
        "benchmark": "grpo_step",
        "settings": {"model": f"tiny:qwen2_5_vl ({args.size})", "prompts": 8, "n": 4, "new_tokens": 32,
                     "workers": 2, "kl_coef": 0.04, "dtype": "float32", "warmup_steps": args.warmup,
                     "overrides": args.override},
        "median_step_s": round(step_s, 3),
        "median_phase_s": {p: round(median(r["phases_s"].get(p, 0.0) for r in records), 4)
                           for p in records[0]["phases_s"]},
        "median_orchestration_s": round(median(r["orchestration_s"] for r in records), 4),
        "median_orchestration_pct": round(100 * overhead, 2),
        "median_generated_tokens_per_s": round(median(r["tokens_per_s"] for r in records), 1),
        "peak_rss_gb_per_role": {name: round(max(r["peak_rss_gb"] for r in readings), 3)
                                 for name, readings in memory.items()},
        "steps": records,
    }
    path = args.out or ROOT / "bench" / "results" / f"grpo_step_{args.size}.json"
    write_result(path, summary)
    print(f"median step {step_s:.3f} s; orchestration {summary['median_orchestration_s']:.3f} s "
          f"({summary['median_orchestration_pct']}% of the step); "
          f"{summary['median_generated_tokens_per_s']} generated tokens/s")
    for phase, seconds in summary["median_phase_s"].items():
        print(f"  {phase:<14} {seconds:.4f} s")
    print(f"  peak RSS per role (GB): {summary['peak_rss_gb_per_role']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
