"""Kill-and-resume trials: does an interrupted run end exactly where an uninterrupted one does?

    .venv/bin/python bench/kill_resume.py [--trials 10] [--seed 0]   # -> bench/results/kill_resume.json

One uninterrupted run of the tiny GRPO setting of tests/test_resume.py (6 steps, a checkpoint every step),
then ``--trials`` runs, each interrupted once at a random moment (after a random step 1-5 plus a random
delay of 0-0.6 s, so kills land in generation, update, weight sync or a checkpoint write), cycling
through four ways to die:

- ``worker``:  SIGKILL of a fused worker (one device's process: actor, reference and rollout); the run
  recovers by itself (trainer.max_failures=1)
- ``driver``:  SIGKILL of the driver; the same command is run again
- ``sigterm``: SIGTERM to the driver (saves, exits 143); the same command is run again

A trial passes when the run exits 0, logged every step exactly once, consumed the same prompts in the
same order and ends with the same actor weights (max |difference| <= 1e-6) as the uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench.provenance import write_result  # noqa: E402
from resume_harness import STEPS, Run, data_order, final_weights, logged_steps, max_difference  # noqa: E402

KINDS = ("worker", "driver", "sigterm")
"""A fused worker (one device's process: actor, reference and rollout), the driver, or a SIGTERM to the driver."""
TOLERANCE = 1e-6


def trial(run_dir: Path, kind: str, step: int, delay: float) -> dict[str, Any]:
    start = time.perf_counter()
    extra = ("trainer.max_failures=1",) if kind == "worker" else ()
    run = Run(run_dir, *extra).start()
    run.wait_for_step(step)
    time.sleep(delay)
    logged_at_kill = logged_steps(run_dir)
    if kind == "worker":
        run.kill_worker("ray::FusedWorker")
    else:
        run.signal_driver(signal.SIGKILL if kind == "driver" else signal.SIGTERM)
    codes = [run.wait()]
    if kind in ("driver", "sigterm"):
        codes.append(Run(run_dir, *extra).start().wait())
    log = run.log.read_text()
    resumed = [line.split("resumed from ")[1].split(":")[0] for line in log.splitlines() if "resumed from " in line]
    return {"kind": kind, "after_step": step, "delay_s": round(delay, 3),
            "steps_logged_at_kill": max(logged_at_kill, default=0), "exit_codes": codes,
            "resumed_from": [Path(r).name for r in resumed], "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "kill_resume.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="easytrain-kill-resume-"))
    reference = work / "uninterrupted"
    assert Run(reference).start().wait() == 0, (reference.parent / "uninterrupted.log").read_text()[-3000:]
    want_weights, want_order = final_weights(reference), data_order(reference)
    results = []
    for i in range(args.trials):
        kind, step, delay = KINDS[i % len(KINDS)], rng.randint(1, STEPS - 1), rng.uniform(0.0, 0.6)
        run_dir = work / f"trial{i}"
        try:
            result = trial(run_dir, kind, step, delay)
            diff = max_difference(final_weights(run_dir), want_weights)
            ok_codes = result["exit_codes"] == ([0] if kind == "worker" else
                                               [-signal.SIGKILL, 0] if kind == "driver" else [143, 0])
            result.update(max_weight_difference=diff, same_order=data_order(run_dir) == want_order,
                          steps_once=logged_steps(run_dir) == list(range(1, STEPS + 1)), expected_exit_codes=ok_codes)
            result["passed"] = bool(ok_codes and result["same_order"] and result["steps_once"] and diff <= TOLERANCE)
        except Exception as err:  # noqa: BLE001 - a trial that breaks is reported, not hidden
            result = {"kind": kind, "after_step": step, "passed": False, "error": f"{type(err).__name__}: {err}"[:2000]}
        results.append(result)
        print(json.dumps(result), flush=True)
        if result["passed"]:
            shutil.rmtree(run_dir, ignore_errors=True)
    passed = sum(r["passed"] for r in results)
    report = {"setting": "tests/resume_harness.py RUN_ARGS: tiny Qwen2.5-VL, 2 fused workers, "
                         f"{STEPS} steps, checkpoint every step",
              "passed": f"{passed}/{len(results)}", "trials": results, "work_dir": str(work)}
    write_result(Path(args.out), report, indent=1)
    print(f"kill-and-resume: {passed}/{len(results)} trials ended exactly as the uninterrupted run "
          f"-> {args.out}")
    if passed == len(results):
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
