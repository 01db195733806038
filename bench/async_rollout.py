"""A GRPO step with separate pools, sync against one step off and async (``trainer.rollout_mode``), in
alternated runs; and the default task's learning in each mode.

    .venv/bin/python bench/async_rollout.py                  # -> bench/results/async_rollout.json
    .venv/bin/python bench/async_rollout.py --rounds 3 --response 48 --learn-steps 192

The real trainer on a local Ray with a pool per role (``trainer.colocate=false``): one worker for the actor
and one for the rollout engine, one torch thread each (a core each on this 2-core machine), no reference
(``algorithm.kl_coef=0``), the HF engine, fp32, the synthetic image task. The response length is chosen so
generation and the update take similar time in the sync mode (both phases are printed and recorded). Each
round runs every mode, the order rotating every round; each run measures ``--steps`` steps after
``--warmup``. One step off, a step is the update and the wait for the next batch, overlapped; the goal is
a step at most ~0.6x the sync one. Async (partial rollouts, calls of half the response length, a queue bounded
by the plan's room), the same, with each step's staleness (token mean and max) and the queue's peak bytes
against its bound recorded.

Learning (``--learn-steps``, 0 skips it): ``python -m easytrain.main`` (the tiny preset's colour question) with
a pool per role in each mode, validated every 16 steps: the first step whose held-out accuracy is >= 0.9. The
goal: async gets there within 25% of the optimizer steps sync takes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.grpo_step import measure  # noqa: E402
from bench.provenance import write_result  # noqa: E402

MODES = ("sync", "one_step_off", "async")
LEARNED = 0.9
VAL_EVERY = 16


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from easytrain.config import load
    from easytrain.distributed.cluster import init_ray

    out_dir = tempfile.mkdtemp(prefix=f"easytrain-async-{mode}-")
    config = load([f"trainer.output_dir={out_dir}", "trainer.colocate=false", "trainer.workers_per_node=1",
                   "trainer.threads_per_worker=1", f"trainer.rollout_mode={mode}", "algorithm.kl_coef=0",
                   "data.num_workers=0", f"data.rollout_batch_size={args.prompts}", f"worker.rollout.n={args.n}",
                   f"worker.actor.global_batch_size={args.prompts}", f"data.max_response_length={args.response}",
                   "trainer.loggers=[jsonl]", "trainer.val_freq=-1", "trainer.save_freq=0",
                   "trainer.val_before_train=false", "data.synthetic_size=256",
                   f"trainer.max_steps={args.warmup + args.steps}", "ray.include_dashboard=false"])
    init_ray(config.ray)
    try:
        records, _ = measure(config, args.steps, args.warmup)
    finally:
        ray.shutdown()
    median = statistics.median
    phases = {p: round(median(r["phases_s"].get(p, 0.0) for r in records), 4) for p in records[0]["phases_s"]}
    return {"mode": mode, "median_step_s": round(median(r["step_s"] for r in records), 4), "median_phase_s": phases,
            "steps_s": [round(r["step_s"], 4) for r in records],
            "staleness": [r["metrics"].get("rollout/staleness") for r in records],
            **({"staleness_max": [r["metrics"]["rollout/staleness_max"] for r in records],
                "queue_peak_gb": max(r["metrics"]["rollout/queue_peak_gb"] for r in records),
                "queue_bound_gb": min(r["metrics"]["rollout/queue_bound_gb"] for r in records),
                "queue_full_s": [round(r["metrics"]["rollout/queue_full_s"], 4) for r in records]}
               if mode == "async" else {})}


def learn(mode: str, steps: int) -> dict[str, Any]:
    """The default task in ``mode`` with a pool per role: its held-out accuracy every 16 steps."""
    import json
    import subprocess

    run_dir = Path(tempfile.mkdtemp(prefix=f"easytrain-learn-{mode}-"))
    command = [sys.executable, "-m", "easytrain.main", "trainer.colocate=false", "trainer.workers_per_node=1",
               f"trainer.rollout_mode={mode}", f"trainer.max_steps={steps}", f"trainer.val_freq={VAL_EVERY}",
               "ray.include_dashboard=false", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], round(r["val/reward/mean"], 4)) for r in rows if "val/reward/mean" in r]
    reached = next((step for step, acc in val if acc >= LEARNED and step > 0), None)
    return {"mode": mode, "val_reward": val, "first_step_at_0.9": reached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response", type=int, default=32, help="data.max_response_length")
    parser.add_argument("--learn-steps", type=int, default=192, help="steps of each learning run; 0 skips them")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "async_rollout.json")
    args = parser.parse_args()

    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for mode in MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]:
            result = {"round": round_, **run(mode, args)}
            runs.append(result)
            print(f"round {round_} {mode:<13} median step {result['median_step_s']:.3f} s  "
                  f"phases {result['median_phase_s']}", flush=True)
    medians = {mode: statistics.median(r["median_step_s"] for r in runs if r["mode"] == mode) for mode in MODES}
    sync_phases = [r["median_phase_s"] for r in runs if r["mode"] == "sync"]
    summary = {
        "benchmark": "async_rollout",
        "settings": {"model": "tiny:qwen2_5_vl", "pools": "actor 1 worker, rollout 1 worker (1 thread each)",
                     "prompts": args.prompts, "n": args.n, "max_response_length": args.response,
                     "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "reference": "none"},
        "median_step_s": {mode: round(value, 4) for mode, value in medians.items()},
        "ratio_one_step_off_over_sync": round(medians["one_step_off"] / medians["sync"], 3),
        "ratio_async_over_sync": round(medians["async"] / medians["sync"], 3),
        "sync_generate_s": round(statistics.median(p.get("generate", 0.0) for p in sync_phases), 4),
        "sync_update_s": round(statistics.median(p.get("update", 0.0) for p in sync_phases), 4),
        "goal": "one_step_off step <= ~0.6x the sync step where generation and the update take similar time",
        "runs": runs,
    }
    if args.learn_steps:
        learning = [learn(mode, args.learn_steps) for mode in MODES]
        reached = {r["mode"]: r["first_step_at_0.9"] for r in learning}
        met = reached["async"] is not None and reached["sync"] is not None and \
            reached["async"] <= 1.25 * reached["sync"]
        summary["learning"] = {"goal": "async reaches held-out accuracy >= 0.9 within 25% of sync's optimizer steps "
                                       f"(validated every {VAL_EVERY} steps)", "met": met, "runs": learning}
        print(f"first step at held-out accuracy >= {LEARNED}: {reached} (goal met: {met})", flush=True)
    write_result(args.out, summary)
    print(f"median step: sync {medians['sync']:.3f} s, one step off {medians['one_step_off']:.3f} s "
          f"(x{summary['ratio_one_step_off_over_sync']}), async {medians['async']:.3f} s "
          f"(x{summary['ratio_async_over_sync']}); sync generate {summary['sync_generate_s']} s, "
          f"update {summary['sync_update_s']} s; wrote {args.out}")


if __name__ == "__main__":
    main()
