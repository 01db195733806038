"""bench/gpu_check.py's parts that run without a GPU (issue 46): it refuses CPU with one line and writes nothing;
its report is written part by part (a failed part, and one the budget did not reach, are recorded, the others
kept); the memory part scores recorded GPU readings against the plan; a rescore keeps the measuring machine's
provenance; and on a real CPU run the memory part measures and scores the load, the steps, the save and the
resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_check  # noqa: E402
from bench.gpu_smoke import RUN_OVERRIDES  # noqa: E402
from bench.provenance import PROVENANCE_KEYS, git_state  # noqa: E402

SMOKE = ROOT / "bench" / "results" / "gpu_smoke.json"
READINGS = ROOT / "tests" / "assets" / "gpu_readings.json"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check measures (minutes), not refuses")
def test_without_a_gpu_it_exits_2_with_one_line_and_writes_nothing() -> None:
    before = gpu_check.RESULTS.read_bytes() if gpu_check.RESULTS.is_file() else None
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs CUDA" in lines[0] and "nothing written" in lines[0], done.stderr
    after = gpu_check.RESULTS.read_bytes() if gpu_check.RESULTS.is_file() else None
    assert after == before


def test_the_report_is_written_after_every_part(tmp_path: Path) -> None:
    path, out = tmp_path / "gpu_check.json", tmp_path / "out"
    report = gpu_check.Report(path, {"steps": 2}, out)
    budget = gpu_check.Budget(3600)

    def broken() -> dict[str, Any]:
        raise RuntimeError("the GPU fell off")

    report.run("machine", lambda: {"device": {"name": "X"}}, budget, 0)
    written = json.loads(path.read_text())
    assert written["parts"]["machine"]["device"] == {"name": "X"}
    assert written["parts_not_run"] == ["step", "memory", "tests", "decode", "first_token"]
    assert all(key in written for key in PROVENANCE_KEYS)

    report.run("step", broken, budget, 0)  # a failure is recorded; what was measured before stays
    report.run("memory", lambda: {"runs": {}}, gpu_check.Budget(-1), 10)  # the budget is spent: not run
    written = json.loads(path.read_text())
    assert written["parts"]["machine"]["device"] == {"name": "X"}
    assert written["parts"]["step"]["failed"] == "RuntimeError: the GPU fell off"
    assert "not_run" in written["parts"]["memory"]
    assert written["parts_not_run"] == ["memory", "tests", "decode", "first_token"]
    assert (out / "gpu_check.json").read_bytes() == path.read_bytes()  # the copy the device tool brings back


def test_nvml_is_read_inside_the_phase_or_just_before_it() -> None:
    samples = [{"t": t, "used_per_gpu": used} for t, used in ((1.0, [10, 5]), (2.0, [30, 6]), (3.0, [20, 9]),
                                                               (4.0, [40, 1]))]
    assert gpu_check.nvml_in(samples, 1.5, 3.5) == [30, 9]  # each GPU's largest inside the span
    assert gpu_check.nvml_in(samples, 2.2, 2.4) == [30, 6]  # shorter than the period: the sample before it
    assert gpu_check.nvml_in([], 0.0, 1.0) is None


def test_the_scores_are_planned_over_measured() -> None:
    measured = {"update": {"device_torch": 100, "process_host": 200, "node_host": 1000},
                "load": {"device_torch": 50, "device_nvml": 80}}
    planned = {"update": {"device_torch": 94, "process_host": 230, "node_host": 1000, "device_nvml": 1},
               "load": {"device_torch": 50, "device_nvml": 80}}
    scored = gpu_check.score_phases(measured, planned)
    assert scored["update"]["device_torch"] == {"measured_bytes": 100, "planned_bytes": 94, "error": -0.06}
    assert scored["update"]["process_host"]["error"] == 0.15
    assert "device_nvml" not in scored["update"]  # not measured: not scored
    accuracy = gpu_check.accuracy({"a": {"scored": scored}})
    assert accuracy["device_torch"] == {"worst_under_prediction": -0.06, "worst_over_prediction": 0.0,
                                        "within_goal": "1 of 2", "misses": {"a:update": -0.06}}
    assert accuracy["process_host"]["misses"] == {"a:update": 0.15}
    assert accuracy["node_host"]["within_goal"] == "1 of 1"


def recorded_runs() -> dict[str, Any]:
    """bench/gpu_smoke.py's H200 runs as gpu_check's memory part records runs: its overrides and torch's peaks."""
    smoke = json.loads(SMOKE.read_text())
    return {name: {"overrides": [*RUN_OVERRIDES, *run["overrides"]],
                   "phases": {phase: {"device_torch": row["measured_bytes"]} for phase, row in run["phases"].items()}}
            for name, run in smoke["runs"].items() if name == "tiny_bf16"}


def test_recorded_gpu_readings_score_against_the_plan_and_a_rescore_keeps_their_provenance(tmp_path: Path) -> None:
    smoke = json.loads(SMOKE.read_text())
    gpu_bytes = smoke["device"]["total_bytes"]
    measuring = {**{k: json.loads(READINGS.read_text())[k] for k in PROVENANCE_KEYS},
                 "command": "python bench/gpu_check.py"}
    stored = {**measuring, "benchmark": "gpu_check", "settings": {},
              "parts": {"machine": {"device": smoke["device"]}, "memory": {"runs": recorded_runs(), "wall_s": 1.0}},
              "parts_not_run": []}
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(stored))

    gpu_check.rescore(path)
    written = json.loads(path.read_text())
    assert {k: written[k] for k in PROVENANCE_KEYS} == measuring  # the H200 machine's, not this one's
    assert written["rescored"]["commit"] == git_state()["commit"]
    memory = written["parts"]["memory"]
    assert memory["split"] == "held_out" and set(memory["accuracy"]) == {"held_out"}
    # the plan's device bytes less the CUDA context equal what bench/gpu_smoke.py's own rescore planned
    for phase, row in memory["runs"]["tiny_bf16"]["scored"].items():
        expected = smoke["runs"]["tiny_bf16"]["phases"][phase]
        assert row["device_torch"]["planned_bytes"] == expected["planned_bytes"], phase
        assert row["device_torch"]["error"] == pytest.approx(expected["planned_bytes"] / expected["measured_bytes"] - 1,
                                                             abs=1e-4)
    assert gpu_check.planned_for(recorded_runs()["tiny_bf16"]["overrides"], gpu_bytes)  # and on CPU, no GPU asked

    gpu_check.rescore(path)  # a second rescore still names the measuring machine
    assert {k: json.loads(path.read_text())[k] for k in PROVENANCE_KEYS} == measuring


@pytest.mark.slow
def test_the_memory_part_scores_a_real_run_with_its_save_and_resume(tiny_model, tmp_path: Path) -> None:
    """The easytrain side on CPU (the tiny model, the small shape's settings): the sampled run, its resume, and
    every phase scored against the plan, the save and the resume included."""
    folder = tiny_model("qwen2_5_vl")
    overrides = gpu_check.run_overrides(folder, "small", 2, "cpu", save=True)
    run = gpu_check.easytrain_run(overrides, tmp_path / "run", tmp_path / "run.log")
    assert len([m for m in run["metrics"] if "time/step" in m]) == 2
    resume = gpu_check.resume_overrides(overrides, 2)
    again = gpu_check.easytrain_run(resume, tmp_path / "run", tmp_path / "resume.log")
    assert [m["step"] for m in again["metrics"] if "time/step" in m] == [3]  # only the new step's lines
    summary = gpu_check.step_summary(run["metrics"], 1, 10**6, None)
    assert summary["steps_measured"] == 1 and summary["median_step_s"] > 0 and summary["update_mfu"] is None

    runs = {"small": {"overrides": overrides, "phases": run["phases"]},
            "small_resume": {"overrides": resume, "phases": again["phases"]}}
    memory = gpu_check.memory_part(runs, None)
    scored = {**memory["runs"]["small"]["scored"], **memory["runs"]["small_resume"]["scored"]}
    assert {"load", "generation", "update", "checkpoint_save", "resume_load"} <= set(scored)
    for phase, row in scored.items():
        for what in ("process_host", "node_host"):
            m, p = row[what]["measured_bytes"], row[what]["planned_bytes"]
            assert m > 0 and p > 0, (phase, what)
            assert row[what]["error"] == round(p / m - 1, 4)
        assert row["node_host"]["measured_bytes"] >= row["process_host"]["measured_bytes"]  # the node holds more
    assert set(memory["accuracy"]["held_out"]) == {"process_host", "node_host"}  # no device on CPU


def test_the_readmes_gpu_record_is_written_from_a_gpu_check_result(tmp_path: Path) -> None:
    """bench/gpu_status.py renders a gpu_check.json as the README's GPU record: the ratios and whether each goal
    was met, the held-out memory accuracy with its misses, the tests' outcomes and the parts not run; a GPU
    test no record holds is listed as never run."""
    from bench import gpu_status

    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "gpu" / "test_a.py").write_text("def test_ran():\n    pass\n\ndef test_never():\n    pass\n")
    record = {"commit": "a" * 40, "date": "2026-12-24T10:00:00+00:00", "parts_not_run": ["decode"], "parts": {
        "machine": {"device": {"name": "NVIDIA H100"}},
        "step": {"shapes": {"small": {"step_rate_vs_trl": 1.2, "goal": 1.5, "goal_met": False,
                                      "easytrain": {"median_step_s": 2.0}, "trl": {"median_step_s": 2.4}}},
                 "sync": {"ratio": 1.5, "goal": 2.0, "goal_met": True}},
        "memory": {"accuracy": {"held_out": {"node_host": {"within_goal": "9 of 10", "worst_under_prediction": -0.07,
                                                           "worst_over_prediction": 0.02,
                                                           "misses": {"small:update": -0.07}}}}},
        "tests": {"counts": {"passed": 1, "failed": 0}, "tests": [{"name": "test_a::test_ran", "outcome": "passed"}]},
        "decode": {"not_run": "the time budget had 3 s left"}}}
    (tmp_path / "bench" / "results" / "gpu_check.json").write_text(json.dumps(record))
    text = gpu_status.markdown(tmp_path)
    assert "(NVIDIA H100, 2026-12-24, measured at aaaaaaa)" in text
    assert "small: 1.20x TRL's step rate (goal 1.5x: NOT met" in text
    assert "weight sync: 1.5x one device copy of the weights (goal 2.0x: met)" in text
    assert "node host, held-out: 9 of 10 phases within the goal, worst -7.0% / +2.0%; misses: small:update" in text
    assert "the GPU suite `tests/gpu`: 1 passed" in text and "part `decode`: the time budget had 3 s left" in text
    never = text.split("never run on a GPU: ")[1]
    assert "test_a.py::test_never" in never and "test_ran" not in never
    assert "`bench/gpu_step.py`" in never and "`bench/gpu_check.py`" not in never


def test_a_part_in_a_child_process_is_bounded_by_the_budget_and_its_failure_recorded() -> None:
    """decode and first_token run in a child of the script (their CUDA state and compilations stay out of the
    parent): a child that fails is recorded with its log's tail, one the budget cannot wait for is stopped."""
    stopped = gpu_check.in_child("first_token", None, gpu_check.Budget(0.5))
    assert stopped == {"failed": "stopped after 1 s: the time budget was spent"}
    if not torch.cuda.is_available():  # here the probe asks for a CUDA device this machine does not have
        failed = gpu_check.in_child("first_token", None, gpu_check.Budget(300))
        assert failed["failed"].startswith("exit ") and failed["log_tail"]
