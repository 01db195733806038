"""The plan's recorded accuracy holds at this commit: bench/results/planner_accuracy.json's measured phases
(whole runs on this machine, the measurements stored in the file) re-planned with this checkout, without
re-running anything (issue 47, item 2). A planner change that moves any phase out of the band fails here;
re-measuring stays a benchmark (``python bench/planner_accuracy.py``).

The band is the benchmark's goal: within 10% of measured and never more than 5% below it. Held-out rows (the
cases no constant was read from) and calibration rows are checked apart, so a failure says which it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.planner_accuracy import BASE, CASES, LOW, RESULTS, WITHIN, predictions  # noqa: E402
from bench.planner_model import bench_model_folder  # noqa: E402

CASE = {case.name: case for case in CASES}


def stored() -> list[dict[str, Any]]:
    return json.loads(RESULTS.read_text())["rows"]


@pytest.fixture(scope="module")
def replanned() -> list[dict[str, Any]]:
    """Every stored phase: its case, split, measured node bytes and this checkout's plan for it."""
    folder = bench_model_folder()
    out = []
    for row in stored():
        predicted = predictions(CASE[row["name"]], folder)
        for phase, figure in row["phases"].items():
            plan = predicted.get(phase)
            out.append({"case": row["name"], "tag": CASE[row["name"]].tag, "phase": phase,
                        "measured": figure["host_bytes"], "planned": plan,
                        "error": None if plan is None else plan / figure["host_bytes"] - 1})
    return out


def test_the_stored_readings_are_of_the_cases_the_benchmark_runs() -> None:
    rows = stored()
    assert {row["name"] for row in rows} == set(CASE), "re-run python bench/planner_accuracy.py: cases changed"
    for row in rows:
        assert row["overrides"] == BASE + CASE[row["name"]].overrides, \
            f"{row['name']}: the stored run's overrides are not the case's; re-measure it (--only {row['name']})"


@pytest.mark.parametrize("tag", ["held_out", "calibration"])
def test_every_phase_stays_in_the_band_at_this_commit(replanned: list[dict[str, Any]], tag: str) -> None:
    rows = [r for r in replanned if r["tag"] == tag]
    assert rows, f"no {tag} rows stored"
    unplanned = [f"{r['case']}:{r['phase']}" for r in rows if r["planned"] is None]
    assert not unplanned, f"{tag}: the plan no longer prices {unplanned}"
    out = [f"{r['case']}:{r['phase']} {r['error']:+.1%} ({r['planned'] / 1e9:.3f} GB planned, "
           f"{r['measured'] / 1e9:.3f} GB measured)" for r in rows if not -LOW <= r["error"] <= WITHIN]
    assert not out, (f"{tag} phases out of the band (within {WITHIN:.0%}, never more than {LOW:.0%} low) "
                     f"at this commit: " + "; ".join(out))
