"""``easytrain submit`` against a real Ray head on loopback (``ray start --head``, token authentication on):
the tiny run is accepted, reaches SUCCEEDED, its logs are fetched, its run folder is written, and while it
runs the head's Prometheus endpoint serves easytrain's gauges."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from easytrain.launch import jobs

import fault_harness

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ray_head(ray_clusters: Any) -> Iterator[dict[str, Any]]:
    """A head node started the way a user starts one (token authentication is Ray 2.60's default)."""
    ray_clusters.stop()  # no in-process Ray beside it
    with fault_harness.ray_head() as head:
        yield head


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError):
        return ""


def test_submit_the_tiny_run_to_a_ray_head_with_token_auth(ray_head: dict[str, Any], tmp_path: Path) -> None:
    address = ray_head["address"]
    with pytest.raises(urllib.error.HTTPError) as refused:  # token authentication is on: no token, no jobs
        urllib.request.urlopen(f"{address}/api/jobs/", timeout=10)
    assert refused.value.code in (401, 403)

    run_dir = tmp_path / "run"
    overrides = ["+exp=tiny", f"hydra.run.dir={run_dir}", "trainer.max_steps=3", "data.synthetic_size=16",
                 "data.synthetic_val_size=4", "data.rollout_batch_size=4", "worker.actor.global_batch_size=4",
                 "worker.rollout.n=2", "worker.actor.micro_batch_size_per_device_for_update=2",
                 "data.max_response_length=4", "trainer.val_before_train=false"]
    out = io.StringIO()
    assert jobs.submit(overrides, address, working_dir=str(ROOT), out=out) == 0
    lines = out.getvalue().splitlines()
    job_id = lines[0].split()[-1]
    assert lines[1] == f"dashboard: {address}/#/jobs/{job_id}"

    gauges, deadline = "", time.monotonic() + 900
    while time.monotonic() < deadline:  # the gauges appear while the run goes on
        state = str(jobs.client(address).get_job_status(job_id).value)
        text = scrape(ray_head["metrics"])
        if "easytrain_reward_mean" in text:
            gauges = text
        if state in jobs.TERMINAL:
            break
        time.sleep(1.0)
    status = io.StringIO()
    jobs.status(job_id, address, out=status)
    logs = io.StringIO()
    jobs.logs(job_id, address, out=logs)
    assert status.getvalue().startswith(f"{job_id}: SUCCEEDED"), logs.getvalue()[-3000:]
    assert "step 3:" in logs.getvalue()  # the driver's console metrics line, fetched through the SDK
    assert "easytrain_reward_mean" in gauges and "easytrain_worker_rss_bytes" in gauges, gauges[-2000:]
    assert 'run="tiny"' in gauges
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2, 3]


def test_submit_refuses_a_relative_run_folder_before_sending_anything() -> None:
    """Issue 24, item 2: the default run folder is relative, so under Ray Jobs it would land in the working
    directory Ray unpacks for the job (deleted with it, unseen by other nodes). No Ray is running here: the
    refusal comes first."""
    from easytrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"hydra.run.dir='outputs/.*': a relative run folder lands in the copy of "
                                          r"the working directory Ray unpacks .* hydra.run.dir=/shared/runs/NAME"):
        jobs.submit(["+exp=tiny"], "http://127.0.0.1:9", working_dir=str(ROOT), out=io.StringIO())


def test_easytrain_stop_saves_the_current_step(ray_head: dict[str, Any], tmp_path: Path) -> None:
    """Issue 24, item 5: ``easytrain stop`` goes through Ray's job supervisor, which sends SIGTERM to the driver
    and every process under it (a data-loader worker here) and SIGKILLs them after RAY_JOB_STOP_WAIT_TIME_S (3 s
    by Ray's default). The job's runtime env raises that to launch.stop_grace_s and the loader workers let the
    SIGTERM pass, so the driver finishes its step, saves it and exits; nothing since the last step is lost."""
    address = ray_head["address"]
    run_dir = tmp_path / "run"
    overrides = ["+exp=tiny", f"hydra.run.dir={run_dir}", "trainer.max_steps=500", "trainer.save_freq=-1",
                 "data.num_workers=1", "data.synthetic_size=64", "data.synthetic_val_size=4",
                 "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=2",
                 "worker.actor.micro_batch_size_per_device_for_update=2", "data.max_response_length=4",
                 "trainer.val_before_train=false", "trainer.val_freq=-1"]
    out = io.StringIO()
    assert jobs.submit(overrides, address, working_dir=str(ROOT), out=out) == 0
    job_id = out.getvalue().splitlines()[0].split()[-1]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and sum('"reward/mean"' in line for line in metrics.read_text().splitlines()) >= 2):
        state = str(jobs.client(address).get_job_status(job_id).value)
        assert state not in jobs.TERMINAL and time.monotonic() < deadline, state
        time.sleep(0.5)
    stopped = io.StringIO()
    assert jobs.stop(job_id, address, out=stopped) == 0 and "stop requested" in stopped.getvalue()
    assert jobs.wait_for(job_id, address, timeout=600) == "STOPPED"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"reward/mean"' in line]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    saved = json.loads((run_dir / "checkpoints" / f"global_step_{latest}" / "trainer_state.json").read_text())
    assert saved["step"] == max(steps) >= 2  # the step in flight finished and was saved
    log = io.StringIO()
    jobs.logs(job_id, address, out=log)
    assert "SIGTERM: saving a checkpoint at the end of the current step" in log.getvalue(), log.getvalue()[-3000:]
    assert "Traceback" not in log.getvalue(), log.getvalue()[-3000:]
