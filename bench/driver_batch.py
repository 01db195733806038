"""The driver's RSS and step time on an image-heavy run, this tree against a commit before it (issue 47, item 4).

    .venv/bin/python bench/driver_batch.py --before e86d1e7               # -> bench/results/driver_batch.json
    .venv/bin/python bench/driver_batch.py --before e86d1e7 --repeats 3
    .venv/bin/python bench/driver_batch.py --before 0b4de34 --repeats 3 --out bench/results/driver_batch_return.json

``driver_batch.json`` measured a rollout batch holding each prompt's pixels once (item 4 of issue 47);
``driver_batch_return.json`` the rollout worker returning the batch without its prompts' visuals (770865a).

The shape (:data:`SHAPE`): the default run (tiny Qwen2.5-VL, synthetic image task, local Ray, CPU, two fused
workers) with 448 x 448 images (``data.min_pixels`` = ``data.max_pixels`` = 200704: 1024 patch rows of 1176
floats, 4.8 MB per image), 4 prompts x 16 responses of at most 8 tokens, 3 steps. A rollout batch then holds 64
samples' images: 308 MB when every sample carries its prompt's rows, 19 MB when each prompt's are held once.

``--before`` is checked out into a temporary git worktree; runs alternate (before, this; this, before; ...) for
``--repeats`` rounds, each ``python -m easytrain.main`` in a fresh process whose ``PYTHONPATH`` is its tree (the
same venv), so the driver and its Ray workers import that tree's easytrain. Per run, from ``/proc`` of the
driver process alone (Ray's and the workers' processes are not counted), read every :data:`SAMPLE_S` s:

- ``driver_steps_peak_rss_gb``: the driver's peak RSS over the steps after the first, exact (the kernel's
  high-water mark ``VmHWM``, reset through ``clear_refs`` as the first step's line reaches metrics.jsonl and
  read as the last step's does): what holding the step's batch costs;
- ``driver_lifetime_peak_rss_gb``: its ``VmHWM`` over the whole run, start-up and the end-of-run validation,
  report and plots included (these set it here, whatever the batch);
- ``mean_step_s``: the mean ``time/step`` of metrics.jsonl over the steps after the first.

The summary is the median over each side's runs, and after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402

SIDE = 448
SHAPE_STEPS = 3
SHAPE = [f"data.min_pixels={SIDE * SIDE}", f"data.max_pixels={SIDE * SIDE}",
         f"data.max_prompt_length={64 + (SIDE // 28) ** 2}", "data.rollout_batch_size=4", "worker.rollout.n=16",
         "worker.actor.global_batch_size=4", "worker.actor.micro_batch_size_per_device_for_update=8",
         "worker.actor.micro_batch_size_per_device_for_experience=8", "data.max_response_length=8",
         f"trainer.max_steps={SHAPE_STEPS}", "trainer.val_before_train=false", "trainer.loggers=[jsonl]",
         "data.num_workers=0"]
"""The run's overrides: the default task, image-heavy (64 text tokens of room besides the 256 image tokens)."""
SAMPLE_S = 0.05
GB = 10**9


def high_water_mark(pid: int) -> int:
    """The process's peak RSS in bytes since it started or its last :func:`reset_high_water_mark` (``VmHWM``); 0
    once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_high_water_mark(pid: int) -> None:
    """Start the process's ``VmHWM`` again from its RSS now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def steps_done(metrics: Path) -> int:
    """Steps the run has logged to its metrics.jsonl (a line each, written as the step ends)."""
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"time/step"' in line)
    except OSError:
        return 0


def run_once(tree: Path, run_dir: Path, log: Path) -> dict[str, Any]:
    """One run of ``tree``'s easytrain on :data:`SHAPE`: the driver's peak RSS over the steps after the first
    (its high-water mark reset as the first step's metrics line appears, read as the last step's does) and over
    its whole life (the end-of-run report and plots included), and the steps' times."""
    env = {**os.environ, "PYTHONPATH": str(tree), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "easytrain.main", *SHAPE, f"hydra.run.dir={run_dir}"]
    metrics, last = run_dir / "metrics.jsonl", SHAPE_STEPS
    start = time.perf_counter()
    lifetime = steps_peak = 0
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
        seen = 0
        while proc.poll() is None:
            lifetime = max(lifetime, high_water_mark(proc.pid))
            done = steps_done(metrics) if seen < last else seen
            if done >= 1 > seen:
                reset_high_water_mark(proc.pid)
            if done >= last > seen:
                steps_peak = high_water_mark(proc.pid)
            seen = done
            time.sleep(SAMPLE_S)
    wall = time.perf_counter() - start
    if proc.returncode or not steps_peak:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"{' '.join(command)} in {tree} failed (exit code {proc.returncode}, {seen} steps seen)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["time/step"] for r in rows if "time/step" in r]
    return {"driver_steps_peak_rss_gb": round(steps_peak / GB, 4),
            "driver_lifetime_peak_rss_gb": round(lifetime / GB, 4),
            "mean_step_s": round(statistics.mean(steps[1:]), 4), "step_s": [round(s, 4) for s in steps],
            "wall_s": round(wall, 1)}


def commit_of(tree: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True,
                          check=True).stdout.strip()


FIGURES = ("driver_steps_peak_rss_gb", "driver_lifetime_peak_rss_gb", "mean_step_s")


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median of each of :data:`FIGURES` over ``runs``."""
    return {key: round(statistics.median(r[key] for r in runs), 4) for key in FIGURES}


def describe(figures: dict[str, Any]) -> str:
    return (f"driver RSS peak {figures['driver_steps_peak_rss_gb']:.3f} GB over steps 2+, "
            f"{figures['driver_lifetime_peak_rss_gb']:.3f} GB lifetime; mean step {figures['mean_step_s']:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit to compare against (any git revision)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs both sides once")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "driver_batch.json")
    args = parser.parse_args()

    before = subprocess.run(["git", "rev-parse", args.before], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="easytrain-driver-batch-"))
    trees = {"before": tmp / "before", "after": ROOT}
    subprocess.run(["git", "worktree", "add", "--detach", str(trees["before"]), before], cwd=ROOT, check=True,
                   capture_output=True)
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    try:
        for round_ in range(args.repeats):
            for side in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
                run = run_once(trees[side], tmp / f"{side}-{round_}", tmp / f"{side}-{round_}.log")
                runs[side].append({"round": round_, "commit": commit_of(trees[side]), **run})
                print(f"round {round_} {side:<6}: {describe(run)} (steps {run['step_s']})", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(trees["before"])], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)

    medians = {side: summary(side_runs) for side, side_runs in runs.items()}
    record = {
        "benchmark": "driver_batch",
        "settings": {"overrides": SHAPE, "repeats": args.repeats, "before": before, "sample_s": SAMPLE_S,
                     "driver_rss": "the driver process's own VmHWM (Ray's and the workers' processes not counted): "
                                   "over the steps after the first (reset as step 1 is logged), and lifetime",
                     "step_time": "mean time/step over the steps after the first"},
        "median": medians,
        "ratio_after_over_before": {key: round(medians["after"][key] / medians["before"][key], 3)
                                    for key in medians["after"]},
        "runs": runs,
    }
    write_result(args.out, record)
    for side, figures in medians.items():
        print(f"{side:<6}: {describe(figures)}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
