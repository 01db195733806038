"""Runs under real RAM pressure: a reward worker takes ballast (``tests/assets/ballast_reward.py``) and the
watchdog's thresholds sit a chosen distance above the RAM the run's own processes need, inside a
``watchdog.ram_limit_gb`` the caller sets (the machine is never near full). Shared by
tests/test_watchdog_pressure.py and bench/watchdog_pressure.py."""

from __future__ import annotations

import json
from pathlib import Path

from resume_harness import Run

GB = 2**30
BALLAST = Path(__file__).parent / "assets" / "ballast_reward.py"
WATCH = [f"reward.function={BALLAST}:spread", "watchdog.sample_period_s=0.2", "watchdog.plot=false"]
EXIT_MEMORY = 4
SOFT_MB = 2048
"""Freed-but-retained heap for the soft case: above soft (+1 GB), below hard (+2.75 GB)."""
HARD_MB = 3584
"""Held ballast for the hard case: above hard."""
"""easytrain.main's exit code after the watchdog's checkpoint-and-stop."""


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "memory.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def run_peak(run_dir: Path) -> int:
    """The highest summed RSS of the run's own processes at one sample (what ``watchdog.ram_scope=run``
    judges), from a run's ``memory.jsonl`` (each sample's process records share its time)."""
    summed: dict[tuple[str, float], int] = {}
    for r in records(run_dir, "process"):
        summed[r["node_id"], r["t"]] = summed.get((r["node_id"], r["t"]), 0) + r["rss_bytes"]
    return max(summed.values())


def limits(peak_used: int, soft_above_gb: float = 1.0, hard_above_gb: float = 2.75) -> list[str]:
    """Thresholds that sit ``soft_above_gb`` / ``hard_above_gb`` above the run's own peak (:func:`run_peak`),
    within a limit 4.5 GB above it. The watchdog judges the run's own processes (``watchdog.ram_scope=run``),
    not the node: other tests and programs on this machine move node RAM by a GB or more between two runs."""
    limit = peak_used + 4.5 * GB
    soft, hard = (peak_used + soft_above_gb * GB) / limit, (peak_used + hard_above_gb * GB) / limit
    return ["watchdog.ram_scope=run", f"watchdog.ram_limit_gb={limit / GB:.4f}", f"watchdog.ram_warn={soft - 0.01:.4f}",
            f"watchdog.ram_soft={soft:.4f}", f"watchdog.ram_hard={hard:.4f}"]


def start_with_ballast(run_dir: Path, command: str, mb: int, *extra: str) -> tuple[Run, Path]:
    ballast = run_dir.parent / f"{run_dir.name}-ballast"
    ballast.mkdir()
    run = Run(run_dir, *WATCH, *extra, env={"EASYTRAIN_TEST_BALLAST": str(ballast)}).start()
    run.wait_for_step(2)
    (ballast / command).write_text(str(mb))  # the next reward call (step 3) claims it
    return run, ballast
