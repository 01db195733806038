"""What the memory watchdog costs: its sampler's CPU time and the driver's work at each step boundary.

    .venv/bin/python bench/watchdog_overhead.py [--steps 24]   # -> bench/results/watchdog_overhead.json

1. One sample (node RAM, the RSS of 7 processes, as the default run has) timed in this process, 500 times:
   the sampler actor spends that much CPU every ``watchdog.sample_period_s``.
2. The default preset (``python -m easytrain.main``, tiny Qwen2.5-VL, 2 CPU workers) run for ``--steps``
   steps with the watchdog on and off, alternated ``--repeats`` times: the driver's boundary work
   (draining the samplers, writing memory.jsonl, judging) is ``time/watchdog`` per step, against
   ``time/step``; each run's median step time is reported too, to show how far runs differ anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from easytrain.memory.readings import node_ram, process_rss  # noqa: E402


def sample_cost(processes: int = 7, repeats: int = 500) -> float:
    pids = [os.getpid()] * processes
    start = time.perf_counter()
    for _ in range(repeats):
        node_ram()
        for pid in pids:
            process_rss(pid)
    return (time.perf_counter() - start) / repeats


def run(run_dir: Path, steps: int, watchdog: bool) -> list[dict[str, Any]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    args = [sys.executable, "-m", "easytrain.main", f"trainer.max_steps={steps}", "trainer.val_before_train=false",
            "trainer.save_freq=-1", "ray.include_dashboard=false", f"watchdog.enabled={str(watchdog).lower()}",
            f"hydra.run.dir={run_dir}"]
    subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True, timeout=3600)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "time/step" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "watchdog_overhead.json"))
    args = parser.parse_args()
    per_sample = sample_cost()
    period = 1.0  # watchdog.sample_period_s default
    work = Path(tempfile.mkdtemp(prefix="easytrain-watchdog-bench-"))
    median = statistics.median
    runs: dict[str, list[list[dict[str, Any]]]] = {"on": [], "off": []}
    for i in range(args.repeats):
        for kind in ("on", "off"):
            runs[kind].append(run(work / f"{kind}{i}", args.steps, kind == "on")[args.warmup:])
    on = [r for records in runs["on"] for r in records]
    boundary = median(r["time/watchdog"] for r in on)
    boundary_share = median(r["time/watchdog"] / r["time/step"] for r in on)
    sampler_share = per_sample / period / (psutil.cpu_count() or 1)
    report = {
        "benchmark": "watchdog_overhead",
        "setting": f"default preset (+exp=tiny), {args.steps} steps per run, first {args.warmup} dropped, "
                   f"watchdog.sample_period_s={period}, on/off alternated {args.repeats} times",
        "sample_ms": round(per_sample * 1e3, 3),
        "sampler_cpu_share_of_machine": round(sampler_share, 5),
        "boundary_ms_median": round(boundary * 1e3, 2),
        "boundary_share_of_step_median": round(boundary_share, 5),
        "step_s_median_per_run": {kind: [round(median(r["time/step"] for r in records), 3) for records in runs[kind]]
                                  for kind in runs},
        "goal": "sampling under 1% of step time",
        "goal_met": bool(boundary_share + sampler_share < 0.01),
    }
    write_result(Path(args.out), report, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
