"""Fault injection, repeated: does every fault end recovered, with nothing lost past the last checkpoint?

    .venv/bin/python bench/faults.py [--trials 10] [--fixed-trials 3] [--only NAME ...]   # -> bench/results/faults.json

Each fault is injected into the tiny default GRPO run (tests/resume_harness.py: 6 steps, a checkpoint every
step) or the SFT preset at the same size, and judged against an uninterrupted run of the same settings by
tests/fault_harness.py: recovered (exit 0, every step logged once, after running the same command again where
a person would), steps lost (finished steps trained again), data lost (prompts, order or final weights differ;
for reward faults: non-finite weights). Faults whose moment is drawn at random get ``--trials`` trials, the
others ``--fixed-trials``. ``memory_in_step_control`` runs the in-step pressure trial with the watchdog off, to
show Ray's memory monitor kills at the line the trials set (it is expected not to recover).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench.provenance import provenance, write_result  # noqa: E402
import fault_harness as fh  # noqa: E402

Trial = Callable[[Path, str, random.Random], Optional[fh.Outcome]]


def moment(rng: random.Random) -> tuple[int, float]:
    """After a random step 1-5 and a random delay of 0-0.6 s: in generation, update, weight sync or a save."""
    return rng.randint(1, fh.STEPS - 1), rng.uniform(0.0, 0.6)


ASYNC_ARGS = (*fh.SEPARATE_POOLS, "trainer.rollout_mode=async", "data.max_response_length=4")
"""``trainer.rollout_mode=async`` (a pool per role), responses of up to 4 tokens generated 2 at a time: a kill
finds a queue and unfinished responses, which the checkpoint holds."""

FAULTS: dict[str, tuple[bool, Trial]] = {
    "sigkill_driver": (True, lambda w, n, r: fh.kill(w, "driver", *moment(r), n)),
    "sigkill_actor": (True, lambda w, n, r: fh.kill(w, "actor", *moment(r), n)),
    "sigkill_rollout": (True, lambda w, n, r: fh.kill(w, "rollout", *moment(r), n)),
    "sigkill_reward": (True, lambda w, n, r: fh.kill(w, "reward", *moment(r), n)),
    "async_sigkill_driver": (True, lambda w, n, r: fh.kill(w, "driver", *moment(r), n, *ASYNC_ARGS)),
    "sigkill_driver_in_save": (True, lambda w, n, r: fh.kill_in_save(w, r.randint(1, fh.STEPS - 1), n)),
    "sft_sigkill_driver": (True, lambda w, n, r: fh.kill(w, "driver", *moment(r), n, *fh.SFT_ARGS)),
    "sft_sigkill_actor": (True, lambda w, n, r: fh.kill(w, "actor", *moment(r), n, *fh.SFT_ARGS)),
    "memory_in_step": (True, lambda w, n, r: fh.memory_in_step(w, n, r)),
    "full_disk_in_save": (False, lambda w, n, r: fh.full_disk(w, n)),
    "truncated_latest_checkpoint": (False, lambda w, n, r: fh.truncated_checkpoint(w, n)),
    "reward_raises": (False, lambda w, n, r: fh.faulty_reward(w, ("raises",), n)),
    "reward_hangs": (False, lambda w, n, r: fh.faulty_reward(w, ("hangs",), n)),
    "reward_nan": (False, lambda w, n, r: fh.faulty_reward(w, ("nan",), n)),
    "dataset_file_removed": (False, lambda w, n, r: fh.dataset_removed(w, n)),
    "easytrain_stop": (True, lambda w, n, r: fh.stop_mid_step(w, *moment(r), n, HEAD["address"])),
}
"""Run in this order; easytrain_stop last: its Ray head would be joined by the local runs' ray.init()."""
HEAD: dict[str, str] = {}
CONTROLS: dict[str, Trial] = {"memory_in_step_control": lambda w, n, r: fh.memory_in_step(w, n, r, control=True)}


def summary(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"trials": len(outcomes), "recovered": sum(o["recovered"] for o in outcomes),
            "steps_lost_max": max((o["steps_lost"] for o in outcomes), default=0),
            "data_lost": sum(o["data_lost"] for o in outcomes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10, help="trials of a fault whose moment is random")
    parser.add_argument("--fixed-trials", type=int, default=3, help="trials of the other faults")
    parser.add_argument("--only", nargs="*", default=None, help="these faults (and controls) alone")
    parser.add_argument("--update", action="store_true",
                        help="keep the other faults of --out as they are (each keeps the commit it was measured at)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "faults.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="easytrain-faults-"))
    chosen = {**{k: v for k, v in FAULTS.items()}, **{k: (False, v) for k, v in CONTROLS.items()}}
    if args.only:
        unknown = set(args.only) - set(chosen)
        if unknown:
            parser.error(f"unknown fault(s) {sorted(unknown)}; known: {', '.join(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.only}
    results: dict[str, Any] = {}
    if args.update and Path(args.out).exists():
        previous = json.loads(Path(args.out).read_text())
        results = {name: {"commit": previous["commit"], **entry} for name, entry in previous["faults"].items()
                   if name not in chosen}
    commit = provenance()["commit"]
    for name, (random_moment, trial) in chosen.items():
        count = 1 if name in CONTROLS else args.trials if random_moment else args.fixed_trials
        head = fh.ray_head() if name == "easytrain_stop" else contextlib.nullcontext({})
        with head as started:
            HEAD.update(started)
            outcomes = run_trials(name, trial, count, work, rng)
        results[name] = {"commit": commit, **summary(outcomes), "random_moment": random_moment, "outcomes": outcomes}
        print(f"{name}: {results[name]['recovered']}/{results[name]['trials']} recovered, "
              f"steps lost at most {results[name]['steps_lost_max']}, data lost in {results[name]['data_lost']}",
              flush=True)
    results = {k: results[k] for k in [*FAULTS, *CONTROLS] if k in results}  # the table's order
    faults = [v for k, v in results.items() if k not in CONTROLS]
    zero = [results[k] for k in ("memory_in_step", "easytrain_stop") if k in results]
    report = {"setting": "tests/resume_harness.py RUN_ARGS (tiny Qwen2.5-VL GRPO, 2 fused workers, 6 steps, a "
                         "checkpoint every step) and tests/fault_harness.py SFT_ARGS (+exp=tiny_sft, same size)",
              "all_recovered": all(v["recovered"] == v["trials"] for v in faults),
              "nothing_lost_past_last_checkpoint": all(v["data_lost"] == 0 and v["steps_lost_max"] <= 1 for v in faults),
              "no_steps_lost_on_stop_and_in_step_pressure": all(v["steps_lost_max"] == 0 for v in zero),
              "faults": results, "work_dir": str(work)}
    write_result(Path(args.out), report, indent=1)
    print(f"faults: all recovered={report['all_recovered']}, nothing lost past the last checkpoint="
          f"{report['nothing_lost_past_last_checkpoint']}, none on stop and in-step pressure="
          f"{report['no_steps_lost_on_stop_and_in_step_pressure']} -> {args.out}")
    if report["all_recovered"]:
        shutil.rmtree(work, ignore_errors=True)


def run_trials(name: str, trial: Trial, count: int, work: Path, rng: random.Random) -> list[dict[str, Any]]:
    outcomes = []
    for i in range(count):
        start = time.perf_counter()
        try:
            outcome = trial(work, f"{name}-{i}", rng)
            if outcome is None:
                print(f"{name}: skipped (needs root to mount a tmpfs)", flush=True)
                break
            record = outcome.as_dict()
        except Exception as err:  # noqa: BLE001 - a trial that breaks is reported, not hidden
            record = {"fault": name, "recovered": False, "steps_lost": -1, "data_lost": True,
                      "seconds": round(time.perf_counter() - start, 1), "error": f"{type(err).__name__}: {err}"[:2000]}
        outcomes.append(record)
        print(json.dumps(record), flush=True)
    return outcomes


if __name__ == "__main__":
    main()
