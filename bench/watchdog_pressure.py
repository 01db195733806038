"""Hard-threshold trials: real RAM pressure stops a run with a checkpoint; does the resumed run lose nothing?

    .venv/bin/python bench/watchdog_pressure.py [--trials 10] [--seed 0]   # -> bench/results/watchdog_pressure.json

One uninterrupted run of the tiny GRPO setting of tests/resume_harness.py (6 steps, a checkpoint every
step) gives the RAM the run's own processes need and the result to match. Each trial then runs the same setting
with the watchdog's thresholds placed above that peak (tests/pressure_harness.py), drops 3.5 GB of held
ballast into a reward worker after a random step 1-4 (so the pressure lands in steps 2-5), expects the
watchdog to save and exit 4, runs the same command again, and compares: every step logged exactly once,
the same prompts in the same order, the same final actor weights (max |difference| <= 1e-6).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench.provenance import write_result  # noqa: E402
from pressure_harness import EXIT_MEMORY, HARD_MB, WATCH, limits, records, run_peak  # noqa: E402
from resume_harness import STEPS, Run, data_order, final_weights, logged_steps, max_difference  # noqa: E402

TOLERANCE = 1e-6


def trial(run_dir: Path, after_step: int, thresholds: list[str]) -> dict[str, Any]:
    start = time.perf_counter()
    ballast = run_dir.parent / f"{run_dir.name}-ballast"
    ballast.mkdir()
    run = Run(run_dir, *WATCH, *thresholds, env={"EASYTRAIN_TEST_BALLAST": str(ballast)}).start()
    run.wait_for_step(after_step)
    (ballast / "hold_mb").write_text(str(HARD_MB))
    first = run.wait()
    stopped_at = max(logged_steps(run_dir), default=0)
    latest = (run_dir / "checkpoints" / "latest")
    saved = int(latest.read_text()) if latest.exists() else None
    second = Run(run_dir, *WATCH, *thresholds).start().wait()
    hard = [e for e in records(run_dir, "event") if e["level"] == "hard"]
    stop = [e for e in records(run_dir, "event") if e["level"] == "stop"]
    return {"after_step": after_step, "exit_codes": [first, second], "stopped_at_step": stopped_at,
            "checkpoint_at_stop": saved, "steps_lost": stopped_at - saved if saved is not None else stopped_at,
            "hard_events": len(hard), "stop_message": stop[0]["message"][:600] if stop else None,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "watchdog_pressure.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="easytrain-pressure-"))
    reference = work / "uninterrupted"
    assert Run(reference, *WATCH).start().wait() == 0, (work / "uninterrupted.log").read_text()[-3000:]
    peak = run_peak(reference)
    thresholds = limits(peak)
    want_weights, want_order = final_weights(reference), data_order(reference)
    results = []
    for i in range(args.trials):
        run_dir = work / f"trial{i}"
        after = rng.randint(1, STEPS - 2)
        try:
            result = trial(run_dir, after, thresholds)
            diff = max_difference(final_weights(run_dir), want_weights)
            result.update(max_weight_difference=diff, same_order=data_order(run_dir) == want_order,
                          steps_once=logged_steps(run_dir) == list(range(1, STEPS + 1)))
            result["passed"] = bool(result["exit_codes"] == [EXIT_MEMORY, 0] and result["steps_lost"] == 0
                                    and result["same_order"] and result["steps_once"] and diff <= TOLERANCE)
        except Exception as err:  # noqa: BLE001 - a trial that breaks is reported, not hidden
            result = {"after_step": after, "passed": False, "error": f"{type(err).__name__}: {err}"[:2000]}
        results.append(result)
        print(json.dumps(result), flush=True)
        if result["passed"]:
            shutil.rmtree(run_dir, ignore_errors=True)
    passed = sum(r["passed"] for r in results)
    report = {"setting": f"tests/resume_harness.py RUN_ARGS + tests/pressure_harness.py WATCH: tiny Qwen2.5-VL, "
                         f"{STEPS} steps, checkpoint every step; {HARD_MB} MB held in a reward worker",
              "reference_peak_run_ram_gb": round(peak / 2**30, 3), "thresholds": thresholds,
              "passed": f"{passed}/{len(results)}",
              "steps_lost_total": sum(r.get("steps_lost", 0) for r in results if "steps_lost" in r),
              "trials": results, "work_dir": str(work)}
    write_result(Path(args.out), report, indent=1)
    print(f"watchdog hard stop + resume: {passed}/{len(results)} trials ended exactly as the uninterrupted run, "
          f"{report['steps_lost_total']} step(s) lost -> {args.out}")
    if passed == len(results):
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
