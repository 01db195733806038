"""Interrupted runs end where an uninterrupted one does: same final weights, same prompts in the same order.

Each run is ``python -m easytrain.main`` in its own process with its own local Ray, 6 steps with a checkpoint every
step, and an interrupted run is run again in its folder. Two folders take several interruptions each, one run after
the other (a module-scoped sequence of runs per folder): each test reads its own interruption and the run that
resumed from it, and the folder must end as the uninterrupted run, which checks every resume in it.

- An actor worker: SIGKILLed after step 3 with trainer.max_failures=0, the run stops with the command to resume;
  run again with trainer.max_failures=1, SIGKILLed after step 4 and recovered inside the run.
- The driver: SIGTERM after step 2 (it saves the step, exits 143); run again, SIGKILL while a checkpoint is written
  (then the checkpoint before it is the latest); run again with background saves, SIGKILL after its first step;
  run again.
"""

from __future__ import annotations

import json
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from resume_harness import STEPS, Run, data_order, final_weights, logged_steps, max_difference

pytestmark = pytest.mark.slow

TOLERANCE = 1e-6  # fp32; the same operations in the same order give equal bits here


@pytest.fixture(scope="module")
def reference(uninterrupted_run: tuple[Path, int]) -> Path:
    return uninterrupted_run[0]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))  # every step logged once, none repeated
    assert data_order(run_dir) == data_order(reference)
    assert max_difference(final_weights(run_dir), final_weights(reference)) <= TOLERANCE
    after_one_step = final_weights(reference / "checkpoints" / "global_step_1")
    assert max_difference(after_one_step, final_weights(reference)) > 100 * TOLERANCE  # training moved them


@dataclass
class Runs:
    """The runs of one folder, one after the other: each one's exit code and its own part of the folder's log,
    and what was seen while they ran."""

    run_dir: Path
    codes: list[int] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    seen: dict[str, Any] = field(default_factory=dict)

    def start(self, *extra: str) -> Run:
        run = Run(self.run_dir, *extra)
        self._offset = len(run.log.read_text()) if run.log.exists() else 0
        return run.start()

    def ended(self, run: Run) -> None:
        self.codes.append(run.wait())
        self.logs.append(run.log.read_text()[self._offset:])

    def resumed_at(self, run: Run, timeout: float = 300) -> int:
        """The step ``run`` resumed from, once it has."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(r"resumed from .*global_step_(\d+)", run.log.read_text()[self._offset:])):
            assert run.proc is not None and run.proc.poll() is None and time.monotonic() < deadline, run.tail()
            time.sleep(0.02)
        return int(found.group(1))


@pytest.fixture(scope="module")
def worker_killed(reference: Path) -> Runs:
    runs = Runs(reference.parent / "worker_killed")
    run = runs.start()  # trainer.max_failures=0
    run.wait_for_step(3)
    run.kill_worker("ray::FusedWorker")  # the process of one device: actor, reference and rollout
    runs.ended(run)
    run = runs.start("trainer.max_failures=1")
    run.wait_for_logged(4, resumed=1)
    time.sleep(0.4)  # past step 4's checkpoint, into step 5
    run.kill_worker("ray::FusedWorker")
    runs.ended(run)
    return runs


def test_a_killed_worker_without_retries_stops_with_the_command_to_resume(worker_killed: Runs,
                                                                          reference: Path) -> None:
    runs = worker_killed
    assert runs.codes[0] == 3, runs.logs[0][-3000:]
    hint = re.search(r"Resume with: (python -m easytrain\.main .*)$", runs.logs[0], re.M)
    assert hint is not None, runs.logs[0][-3000:]
    assert f"hydra.run.dir={runs.run_dir}" in hint.group(1)
    assert runs.codes[1] == 0, runs.logs[1][-3000:]
    assert "resumed from" in runs.logs[1].split("recreating the worker groups")[0]  # at its start
    assert_same_run(runs.run_dir, reference)


def test_a_killed_worker_is_recovered_inside_the_run(worker_killed: Runs, reference: Path) -> None:
    runs = worker_killed
    assert runs.codes[1] == 0, runs.logs[1][-3000:]
    log = runs.logs[1]
    assert re.search(r"dead: worker rank \d on node", log), log[-3000:]
    assert "recreating the worker groups and resuming from the latest checkpoint" in log
    assert "resumed from" in log.split("recreating the worker groups")[1]
    assert_same_run(runs.run_dir, reference)


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


@pytest.fixture(scope="module")
def driver_stopped(reference: Path) -> Runs:
    runs = Runs(reference.parent / "driver_stopped")
    run = runs.start()
    run.wait_for_step(2)
    run.signal_driver(signal.SIGTERM)
    runs.ended(run)
    runs.seen["sigterm"] = {"logged": logged_steps(runs.run_dir), "latest": latest(runs.run_dir)}

    run = runs.start()
    runs.resumed_at(run)
    root = runs.run_dir / "checkpoints"
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".tmp_") for p in root.iterdir()):  # its first checkpoint, being written
        assert run.proc is not None and run.proc.poll() is None and time.monotonic() < deadline, run.tail()
        time.sleep(0.001)
    writing = [p.name for p in root.iterdir() if p.name.startswith(".tmp_")]
    run.signal_driver(signal.SIGKILL)
    runs.ended(run)
    runs.seen["sigkill"] = {"logged": logged_steps(runs.run_dir), "writing": writing}

    run = runs.start("trainer.checkpoint_async=true")
    run.wait_for_logged(runs.resumed_at(run) + 1, resumed=2)
    run.signal_driver(signal.SIGKILL)  # maybe while that step's checkpoint is written in the background
    runs.ended(run)

    runs.ended(runs.start("trainer.checkpoint_async=true"))
    return runs


def test_sigterm_saves_the_current_step_then_exits_and_resumes(driver_stopped: Runs, reference: Path) -> None:
    runs = driver_stopped
    assert runs.codes[0] == 128 + signal.SIGTERM, runs.logs[0][-3000:]
    last = max(runs.seen["sigterm"]["logged"])
    assert last < STEPS
    assert runs.seen["sigterm"]["latest"] == str(last)  # saved before exiting
    assert re.search(rf"stopped at step {last} \(SIGTERM\)", runs.logs[0])
    assert f"global_step_{last}: step {last} of {STEPS}" in runs.logs[1]  # the same command resumes there
    assert runs.codes[-1] == 0, runs.logs[-1][-3000:]
    assert_same_run(runs.run_dir, reference)


def test_a_killed_driver_resumes_when_run_again(driver_stopped: Runs, reference: Path) -> None:
    """Killed while a checkpoint is written: run again, it resumes from the checkpoint before it."""
    runs = driver_stopped
    assert runs.codes[1] == -signal.SIGKILL and runs.seen["sigkill"]["writing"]
    logged = max(runs.seen["sigkill"]["logged"])
    assert logged < STEPS
    resumed = re.search(r"resumed from .*global_step_(\d+)", runs.logs[2])
    assert resumed is not None, runs.logs[2][-3000:]
    assert logged - 1 <= int(resumed.group(1)) <= logged  # one step lost at most: the one being saved
    assert runs.codes[-1] == 0, runs.logs[-1][-3000:]
    assert_same_run(runs.run_dir, reference)


def test_a_run_with_background_saves_resumes_like_an_uninterrupted_one(driver_stopped: Runs, reference: Path) -> None:
    """The harness run (a checkpoint every step) with background saves, its driver killed after a step (maybe while
    a write is in flight: then the checkpoint before it is the latest) and run again: the same steps, data order and
    final weights as the uninterrupted run with blocking saves."""
    runs = driver_stopped
    assert runs.codes[2] == -signal.SIGKILL
    assert runs.codes[3] == 0, runs.logs[3][-3000:]
    log = runs.logs[3]
    assert "writing in the background" in log and re.search(r"resumed from .*global_step_\d", log)
    assert logged_steps(runs.run_dir) == list(range(1, STEPS + 1))
    assert data_order(runs.run_dir) == data_order(reference)
    assert max_difference(final_weights(runs.run_dir), final_weights(reference)) <= 1e-6
    records = [json.loads(line) for line in (runs.run_dir / "metrics.jsonl").read_text().splitlines()]
    saved = [r for r in records if "checkpoint/blocked_s" in r]
    assert saved and all(r["checkpoint/write_s"] > 0 for r in saved)
    assert int(saved[-1]["checkpoint/step"]) == STEPS
