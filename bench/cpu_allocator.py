"""What fixing glibc's mmap threshold in CPU workers (``trainer.malloc_mmap_threshold_kb``) saves and costs, and
whether the plan holds for both settings.

    .venv/bin/python bench/cpu_allocator.py [--repeats 2]   # -> bench/results/cpu_allocator.json

Three shapes, each run with the threshold unset (null: glibc's dynamic threshold, the default) and fixed at
128 KiB (glibc's starting value, kept from rising), alternated ``--repeats`` times:

- ``tiny``: the default preset (``python -m easytrain.main``, tiny Qwen2.5-VL, small images, 2 fused CPU
  workers), 12 steps;
- ``images_448``: the small random Qwen2.5-VL on the same task with 448 x 448 images (256 vision tokens each),
  4 prompts x 8 responses, 2 fused workers, 4 steps: the image-heavy shape;
- ``mid``: GRPO on the ~184M-parameter bench model of ``bench/planner_model.py`` over 2 fused ranks (the
  planner accuracy bench's ``mid_rl_fused`` case), 3 steps.

For each run: every worker call's exact host peak from ``memory.jsonl`` (``phase_peak``: VmHWM, reset at the
call's start), the largest per phase over ranks and steps, beside the plan's figure for the busiest worker
process in that phase (``easytrain plan``'s GB/proc, for the run's own overrides); the median ``time/update``
and ``time/step`` after the first step.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.planner_model import BENCH_MODEL, bench_model_folder  # noqa: E402
from bench.provenance import write_result  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "cpu_allocator.json"
COMMON = ["trainer.val_before_train=false", "trainer.val_freq=-1", "trainer.save_freq=-1", "trainer.export_final=false",
          "ray.include_dashboard=false", "data.num_workers=0"]
SETTINGS = {
    "tiny": ["trainer.max_steps=12"],
    "images_448": ["trainer.max_steps=4", "model.path=tiny:qwen2_5_vl", "model.tiny_size=small",
                   "data.min_pixels=200704", "data.max_pixels=200704", "data.max_prompt_length=320",
                   "data.rollout_batch_size=4", "worker.rollout.n=8", "worker.actor.global_batch_size=4",
                   "worker.actor.micro_batch_size_per_device_for_update=4"],
    "mid": ["trainer.max_steps=3", "data.max_prompt_length=64", f"model.path={BENCH_MODEL}",
            "data.max_response_length=32", "data.rollout_batch_size=4", "worker.actor.global_batch_size=4",
            "worker.rollout.n=2", "worker.actor.micro_batch_size_per_device_for_update=2",
            "worker.actor.micro_batch_size_per_device_for_experience=2"],
}
THRESHOLDS = {"glibc_dynamic": "null", "fixed_128k": "128"}


def planned_process_peaks(overrides: list[str]) -> dict[str, int]:
    """The plan's host bytes of the busiest worker process per phase, for a run's overrides."""
    from bench.planner_accuracy import planned_rows

    return {phase: row["process_host"] for phase, row in planned_rows(overrides).items()}


def run(run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    args = [sys.executable, "-m", "easytrain.main", *overrides, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    peaks: dict[str, int] = {}
    for r in map(json.loads, (run_dir / "memory.jsonl").read_text().splitlines()):
        if r.get("kind") == "phase_peak":
            peaks[r["phase"]] = max(peaks.get(r["phase"], 0), int(r["host_bytes"]))
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "time/step" in r]
    later = steps[1:] or steps
    return {"host_peak_bytes": peaks, "update_s": statistics.median(r["time/update"] for r in later),
            "step_s": statistics.median(r["time/step"] for r in later), "steps": len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    folder = bench_model_folder()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {t: [] for t in THRESHOLDS} for s in SETTINGS}
    work = Path(tempfile.mkdtemp(prefix="easytrain-allocator-bench-"))
    try:
        for repeat in range(args.repeats):
            for setting, extra in SETTINGS.items():
                for name, value in THRESHOLDS.items():
                    overrides = [o.replace(BENCH_MODEL, str(folder)) for o in COMMON + extra]
                    overrides.append(f"trainer.malloc_mmap_threshold_kb={value}")
                    result = run(work / f"{setting}-{name}-{repeat}", overrides)
                    planned = planned_process_peaks(overrides)
                    result["plan_error"] = {phase: round(planned[phase] / peak - 1, 4)
                                            for phase, peak in result["host_peak_bytes"].items() if phase in planned}
                    runs[setting][name].append(result)
                    print(f"{setting} {name} #{repeat}: update {result['update_s']:.2f} s, step {result['step_s']:.2f} s, "
                          f"update peak {result['host_peak_bytes'].get('update', 0) / 1e9:.3f} GB", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for setting, by in runs.items():
        def median(name: str, pick: Any) -> float:
            return statistics.median(pick(r) for r in by[name])

        fixed, dynamic = "fixed_128k", "glibc_dynamic"
        summary[setting] = {
            "update_peak_gb": {n: round(median(n, lambda r: r["host_peak_bytes"].get("update", 0)) / 1e9, 3)
                               for n in THRESHOLDS},
            "update_s": {n: round(median(n, lambda r: r["update_s"]), 3) for n in THRESHOLDS},
            "step_s": {n: round(median(n, lambda r: r["step_s"]), 3) for n in THRESHOLDS},
        }
        s = summary[setting]
        s["plan_error_worst"] = {n: {"under": min(e for r in by[n] for e in r["plan_error"].values()),
                                     "over": max(e for r in by[n] for e in r["plan_error"].values())}
                                 for n in THRESHOLDS}
        s["update_time_change"] = round(s["update_s"][fixed] / s["update_s"][dynamic] - 1, 3)
        s["step_time_change"] = round(s["step_s"][fixed] / s["step_s"][dynamic] - 1, 3)
        s["update_peak_change"] = round(s["update_peak_gb"][fixed] / s["update_peak_gb"][dynamic] - 1, 3)
        print(f"{setting}: {json.dumps(s)}")
    write_result(RESULTS, {"settings": {k: COMMON + v for k, v in SETTINGS.items()}, "thresholds": THRESHOLDS,
                           "repeats": args.repeats, "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
