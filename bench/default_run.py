"""The README's default run, measured: wall time and reward curve of `python -m easytrain.main`.

    .venv/bin/python bench/default_run.py                  # writes bench/results/default_run.json
    .venv/bin/python bench/default_run.py --exp tiny_vllm  # writes bench/results/run_tiny_vllm.json

Runs the embedded default (tiny Qwen2.5-VL, synthetic image task, local Ray,
CPU) exactly as the README's first command does, in a fresh process, with the
run folder in a temporary directory; then reads its metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exp", default=None, help="a preset of conf/exp (default: none, i.e. the tiny default)")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="easytrain-default-run-"))
    command = [sys.executable, "-m", "easytrain.main", f"hydra.run.dir={run_dir}"]
    if args.exp:
        command.insert(3, f"+exp={args.exp}")
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"the default run failed with exit code {done.returncode}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    val = [r for r in rows if "val/reward/mean" in r]
    record = {
        "benchmark": "default_run" if not args.exp else f"run_{args.exp}",
        "run_command": "python -m easytrain.main" + (f" +exp={args.exp}" if args.exp else ""),
        "wall_s": round(wall, 1), "steps": len(steps),
        "median_step_s": round(sorted(r["time/step"] for r in steps)[len(steps) // 2], 3),
        "reward_curve": [[r["step"], round(r["reward/mean"], 4)] for r in steps],
        "val_reward": [[r["step"], round(r["val/reward/mean"], 4)] for r in val],
    }
    synced = [r["rollout/log_prob_diff_max"] for r in steps if "rollout/log_prob_diff_max" in r]
    if synced:  # the engine's log-probs against the actor's recomputation, every step
        record["max_rollout_log_prob_diff"] = max(synced)
    rss = [r["memory/rollout_rss_gb_max"] for r in steps if "memory/rollout_rss_gb_max" in r]
    if rss:
        record["rollout_rss_gb"] = {"first_step": round(rss[0], 4), "step_10": round(rss[min(9, len(rss) - 1)], 4),
                                    "last_step": round(rss[-1], 4)}
    memory = run_dir / "memory.jsonl"
    if memory.exists():  # the watchdog on a healthy run: what it reported, what it cost
        events = [e for e in map(json.loads, memory.read_text().splitlines()) if e["kind"] == "event"]
        shares = sorted(r["time/watchdog"] / r["time/step"] for r in steps if "time/watchdog" in r)
        record["watchdog"] = {"events": [{k: e[k] for k in ("step", "level", "message")} for e in events],
                              "memory_png": (run_dir / "memory.png").exists(),
                              "boundary_share_of_step_median": round(shares[len(shares) // 2], 5) if shares else None}
    out = ROOT / "bench" / "results" / ("default_run.json" if not args.exp else f"run_{args.exp}.json")
    write_result(out, record)
    print(f"{record['run_command']}: {wall:.1f} s wall, {len(steps)} steps, median step {record['median_step_s']} s")
    print("train reward:", " ".join(f"{s}:{r:.2f}" for s, r in record["reward_curve"]))
    print("val reward:", record["val_reward"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
