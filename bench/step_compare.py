"""``bench/grpo_step.py``'s step time on this tree against a baseline commit, in alternated runs.

    .venv/bin/python bench/step_compare.py --baseline e31d0ec            # -> bench/results/step_compare.json
    .venv/bin/python bench/step_compare.py --baseline e31d0ec --rounds 4 --size small

The baseline is checked out into a temporary git worktree. Each round runs
``grpo_step.py`` once per side (the order flips every round, so drift on the
machine hits both alike), each in its own process whose ``PYTHONPATH`` is
its tree, so the driver and its Ray workers import that tree's easytrain.
Per side it records every run's median step and the median over the runs;
the ratio is this tree's over the baseline's (below 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402


def run_side(tree: Path, size: str, steps: int, out: Path) -> dict[str, Any]:
    """One grpo_step run of ``tree``'s code: its result file."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(tree / "bench" / "grpo_step.py"), "--size", size, "--steps", str(steps),
                    "--out", str(out)], cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the commit to compare against (any git revision)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "step_compare.json")
    args = parser.parse_args()

    baseline = subprocess.run(["git", "rev-parse", args.baseline], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="easytrain-step-compare-") as tmp:
        base_tree = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), baseline], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            trees = {"baseline": base_tree, "this": ROOT}
            runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
            for round_ in range(args.rounds):
                order = ["baseline", "this"] if round_ % 2 == 0 else ["this", "baseline"]
                for side in order:
                    result = run_side(trees[side], args.size, args.steps, Path(tmp) / f"{side}-{round_}.json")
                    runs[side].append({"round": round_, "commit": result["commit"], "dirty": result["dirty"],
                                       "median_step_s": result["median_step_s"],
                                       "median_phase_s": result["median_phase_s"]})
                    print(f"round {round_} {side:<8} median step {result['median_step_s']:.3f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)

    medians = {side: statistics.median(r["median_step_s"] for r in results) for side, results in runs.items()}
    summary = {
        "benchmark": "step_compare",
        "settings": {"script": "bench/grpo_step.py", "size": args.size, "steps": args.steps, "rounds": args.rounds,
                     "baseline": baseline},
        "median_step_s": {side: round(value, 4) for side, value in medians.items()},
        "ratio_this_over_baseline": round(medians["this"] / medians["baseline"], 3),
        "runs": runs,
    }
    write_result(args.out, summary)
    print(f"median step: baseline {medians['baseline']:.3f} s, this tree {medians['this']:.3f} s "
          f"(x{summary['ratio_this_over_baseline']}); wrote {args.out}")


if __name__ == "__main__":
    main()
