"""Interrupted runs end where an uninterrupted one does: same final weights, same prompts in the same order.

Each run is ``python -m easytrain.main`` in its own process with its own local Ray, interrupted at step 3 of
6 (a checkpoint every step, so the kill lands while step 4 runs or step 3's checkpoint is written):
SIGKILL of an actor worker (recovered inside the run, or reported with the command to resume), SIGKILL of
the driver (then the same command again), SIGTERM of the driver (saves, exits 143, then the same command).
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

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


def test_a_killed_worker_is_recovered_inside_the_run(reference: Path) -> None:
    run = Run(reference.parent / "worker_killed", "trainer.max_failures=1").start()
    run.wait_for_step(3)
    time.sleep(0.4)  # past step 3's checkpoint, into step 4 (the next test kills during the save)
    run.kill_worker("ray::FusedWorker")  # the process of one device: actor, reference and rollout
    assert run.wait() == 0, run.tail()
    log = run.log.read_text()
    assert re.search(r"dead: worker rank \d on node", log), run.tail()
    assert "recreating the worker groups and resuming from the latest checkpoint" in log
    assert "resumed from" in log
    assert_same_run(run.run_dir, reference)


def test_a_killed_worker_without_retries_stops_with_the_command_to_resume(reference: Path) -> None:
    run_dir = reference.parent / "worker_killed_no_retry"
    run = Run(run_dir).start()
    run.wait_for_step(3)
    run.kill_worker("ray::FusedWorker")  # the process of one device: actor, reference and rollout
    assert run.wait() == 3, run.tail()
    hint = re.search(r"Resume with: (python -m easytrain\.main .*)$", run.log.read_text(), re.M)
    assert hint is not None, run.tail()
    assert f"hydra.run.dir={run_dir}" in hint.group(1)
    rerun = Run(run_dir).start()
    assert rerun.wait() == 0, rerun.tail()
    assert "resumed from" in rerun.log.read_text()
    assert_same_run(run_dir, reference)


def test_a_killed_driver_resumes_when_run_again(reference: Path) -> None:
    run_dir = reference.parent / "driver_killed"
    run = Run(run_dir).start()
    run.wait_for_step(3)
    run.signal_driver(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    assert max(logged_steps(run_dir)) < STEPS
    rerun = Run(run_dir).start()
    assert rerun.wait() == 0, rerun.tail()
    assert re.search(r"resumed from .*global_step_\d", rerun.log.read_text())
    assert_same_run(run_dir, reference)


def test_sigterm_saves_the_current_step_then_exits_and_resumes(reference: Path) -> None:
    run_dir = reference.parent / "sigterm"
    run = Run(run_dir).start()
    run.wait_for_step(2)
    run.signal_driver(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM, run.tail()
    last = max(logged_steps(run_dir))
    assert last < STEPS
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == str(last)  # saved before exiting
    assert re.search(rf"stopped at step {last} \(SIGTERM\)", run.log.read_text())
    rerun = Run(run_dir).start()
    assert rerun.wait() == 0, rerun.tail()
    assert f"global_step_{last}: step {last} of {STEPS}" in rerun.log.read_text()
    assert_same_run(run_dir, reference)


def test_a_run_with_background_saves_resumes_like_an_uninterrupted_one(reference: Path) -> None:
    """The harness run of test_resume (a checkpoint every step) with background saves, its driver killed after
    step 3 (maybe while a write is in flight: then the checkpoint before it is the latest) and run again: the
    same steps, data order and final weights as the uninterrupted run with blocking saves."""
    run_dir = reference.parent / "background_saves"
    run = Run(run_dir, "trainer.checkpoint_async=true").start()
    run.wait_for_step(3)
    run.signal_driver(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    rerun = Run(run_dir, "trainer.checkpoint_async=true").start()
    assert rerun.wait() == 0, rerun.tail()
    log = rerun.log.read_text()
    assert "writing in the background" in log and re.search(r"resumed from .*global_step_\d", log)
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    assert data_order(run_dir) == data_order(reference)
    assert max_difference(final_weights(run_dir), final_weights(reference)) <= 1e-6
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    saved = [r for r in records if "checkpoint/blocked_s" in r]
    assert saved and all(r["checkpoint/write_s"] > 0 for r in saved)
    assert int(saved[-1]["checkpoint/step"]) == STEPS
