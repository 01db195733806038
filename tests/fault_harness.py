"""Faults injected into real runs of ``python -m easytrain.main`` (issue 24's fault-injection suite): shared by
``tests/faults/`` (one trial of each) and ``bench/faults.py`` (repeated trials -> bench/results/faults.json).

Every trial is judged the same way against an uninterrupted run of the same settings:

- ``recovered``: the run (by itself, or run again with the same command where a person would) exits 0 having
  logged every step exactly once;
- ``steps_lost``: steps that had finished when the fault hit and had to be trained again (the last step logged
  before the fault minus the step the run resumed from);
- ``data_lost``: anything of the finished run differs from the uninterrupted one: the prompts it consumed and
  their order, or its final weights (max |difference| > 1e-6). Faults that change what is trained (a reward
  that raises, hangs or returns NaN) are judged instead on finite weights and every step logged once.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from resume_harness import ROOT, STEPS, Run, data_order, final_weights, max_difference

GB = 2**30
FAULTY = ROOT / "tests" / "assets" / "faulty_reward.py"
BALLAST = ROOT / "tests" / "assets" / "ballast_reward.py"
SFT_ARGS = ["+exp=tiny_sft", "data.synthetic_size=24", "data.rollout_batch_size=4",
            "worker.actor.global_batch_size=4", "worker.actor.micro_batch_size_per_device_for_update=2",
            "trainer.val_freq=-1", "trainer.export_final=false", "data.max_response_length=4"]
"""The SFT preset at the harness's size: 6 steps of 4 samples (crossing no epoch), a checkpoint every step."""
TOLERANCE = 1e-6
EXIT_MEMORY = 4
MEMORY_WATCH = ("watchdog.sample_period_s=0.2", "watchdog.plot=false", f"reward.function={BALLAST}:spread",
                "trainer.max_failures=0")
"""The in-step pressure trials' settings: those of tests/pressure_harness.py (the test session's reference)."""


@dataclass
class Outcome:
    fault: str
    recovered: bool
    steps_lost: int
    data_lost: bool
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def steps_of(run_dir: Path, key: str = "reward/mean") -> list[int]:
    """Training records in metrics.jsonl, in file order (``key``: the task's headline metric)."""
    path = run_dir / "metrics.jsonl"
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a SIGKILL
            continue
        if key in record:
            out.append(record["step"])
    return out


def headline(extra: tuple[str, ...]) -> str:
    return "train/loss" if "+exp=tiny_sft" in extra else "reward/mean"


def resumed_from(*logs: Path) -> list[int]:
    """Steps of the checkpoints the runs resumed from, in order."""
    found = []
    for log in logs:
        for line in log.read_text().splitlines() if log.exists() else []:
            if "resumed from " in line:
                found.append(int(line.split("resumed from ")[1].split(":")[0].rsplit("_", 1)[1]))
    return found


REFERENCES: dict[tuple[str, ...], Path] = {}
"""Uninterrupted runs made elsewhere, by the settings they share numerics with (the test session's reference)."""


def reference(work: Path, *extra: str) -> Path:
    """The uninterrupted run of these settings (made once per ``work`` folder and settings)."""
    if extra in REFERENCES:
        return REFERENCES[extra]
    name = "reference-" + (str(abs(hash(extra)))[:10] if extra else "default")
    run_dir = work / name
    if not (run_dir / "checkpoints" / "latest").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        run = Run(run_dir, *extra).start()
        assert run.wait() == 0, run.tail()
    return run_dir


def judge(fault: str, run_dir: Path, ref: Path, codes: list[int], logged_at_fault: int, start: float,
          extra: tuple[str, ...] = (), exact: bool = True, log: Optional[Path] = None, rows_only: bool = False,
          **detail: Any) -> Outcome:
    """``rows_only``: prompts are compared by their row in the file (the run read a copy of the reference's file,
    whose path their ids carry)."""
    key = headline(extra)
    steps = steps_of(run_dir, key)
    resumed = resumed_from(log or run_dir.parent / f"{run_dir.name}.log")
    once = steps == list(range(1, STEPS + 1))
    recovered = codes[-1] == 0 and once
    lost = max(0, logged_at_fault - min(resumed)) if resumed else 0
    if not recovered:
        data_lost = True
    elif exact:
        def rows(folder: Path) -> list[list[str]]:
            return [[uid.rsplit("#", 1)[-1] if rows_only else uid for uid in step] for step in data_order(folder)]

        same_order = "+exp=tiny_sft" in extra or rows(run_dir) == rows(ref)
        difference = max_difference(final_weights(run_dir), final_weights(ref))
        detail["max_weight_difference"] = difference
        data_lost = not same_order or difference > TOLERANCE
    else:
        weights = final_weights(run_dir)
        data_lost = not all(bool(v.isfinite().all()) for v in weights.values())
    return Outcome(fault, recovered, lost, data_lost, round(time.perf_counter() - start, 1),
                   {"exit_codes": codes, "logged_at_fault": logged_at_fault, "resumed_from": resumed, **detail})


# ----------------------------------------------------------------------------- kills at random moments

KILL_TITLES = {"actor": "ray::FusedWorker", "rollout": "ray::RolloutWorker", "reward": "ray::RewardWorker"}
"""Process titles of the workers a kill targets (the actor's rank is a fused worker in the default layout; the
rollout has its own workers with trainer.colocate=false)."""

SEPARATE_POOLS = ("trainer.colocate=false", "trainer.workers_per_node=1")
"""The layout a rollout kill needs: the rollout has its own processes (one per role on this 2-CPU machine)."""


def kill(work: Path, target: str, step: int, delay: float, name: str, *extra: str) -> Outcome:
    """SIGKILL of the driver (then the same command again) or of one worker (the run recovers by itself,
    trainer.max_failures=1) ``delay`` seconds after ``step`` was logged."""
    if target == "rollout":
        extra = (*extra, *SEPARATE_POOLS)
    ref = reference(work, *extra)
    run_dir, start = work / name, time.perf_counter()
    args = (*extra, "trainer.max_failures=1") if target != "driver" else extra
    run = Run(run_dir, *args).start()
    wait_for(run, step, extra)
    time.sleep(delay)
    if target == "driver":
        run.signal_driver(signal.SIGKILL)
    else:
        run.kill_worker("ray::SFTWorker" if "+exp=tiny_sft" in extra else KILL_TITLES[target])
    codes = [run.wait()]
    logged = max(steps_of(run_dir, headline(extra)), default=0) if target == "driver" else step_at_kill(run_dir, extra)
    if target == "driver":
        codes.append(Run(run_dir, *args).start().wait())
    return judge(f"sigkill_{target}", run_dir, ref, codes, logged, start, extra, after_step=step,
                 delay_s=round(delay, 3))


def kill_in_turn(work: Path, kills: tuple[tuple[str, int], ...], delay: float, name: str,
                 *extra: str) -> list[Outcome]:
    """One run, trainer.max_failures=len(kills): each (target, step) of ``kills`` in turn, its worker SIGKILLed
    ``delay`` seconds after ``step`` was logged (after the run recovered from the kill before it), the run
    recovering by itself each time. An Outcome per kill, each judged like :func:`kill`'s on the whole run, its
    steps lost those of its own recovery."""
    if any(target == "rollout" for target, _ in kills):
        extra = (*extra, *SEPARATE_POOLS)
    ref = reference(work, *extra)
    run_dir, start = work / name, time.perf_counter()
    run = Run(run_dir, *extra, f"trainer.max_failures={len(kills)}").start()
    for recovered, (target, step) in enumerate(kills):
        run.wait_for_logged(step, resumed=recovered)
        time.sleep(delay)
        run.kill_worker("ray::SFTWorker" if "+exp=tiny_sft" in extra else KILL_TITLES[target])
    codes = [run.wait()]
    at_kills, resumed = steps_at_recoveries(run_dir), resumed_from(run.log)
    outcomes = []
    for i, (target, step) in enumerate(kills):
        outcome = judge(f"sigkill_{target}", run_dir, ref, codes, 0, start, extra, after_step=step,
                        delay_s=round(delay, 3), logged_at_kills=at_kills)
        if len(at_kills) == len(resumed) == len(kills):  # one recovery per kill
            outcome.steps_lost = max(0, at_kills[i] - resumed[i])
        else:
            outcome.recovered = False
        outcomes.append(outcome)
    return outcomes


def steps_at_recoveries(run_dir: Path) -> list[int]:
    """For a run that recovered by itself: the last step logged before each of its recoveries began (see
    :func:`step_at_kill`)."""
    log = (run_dir.parent / f"{run_dir.name}.log").read_text().splitlines()
    cuts = [i for i, line in enumerate(log) if "recreating the worker groups" in line]
    return [max([int(line.split("step ")[1].split(":")[0]) for line in log[:cut]
                 if "][easytrain.metrics][INFO] - step " in line and "val/" not in line], default=0) for cut in cuts]


def wait_for(run: Run, step: int, extra: tuple[str, ...], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while step not in steps_of(run.run_dir, headline(extra)):
        assert run.proc is not None and run.proc.poll() is None, f"run exited early:\n{run.tail()}"
        assert time.monotonic() < deadline, f"step {step} not reached:\n{run.tail()}"
        time.sleep(0.02)


def step_at_kill(run_dir: Path, extra: tuple[str, ...]) -> int:
    """For a run that recovered by itself: the last step logged before its recovery began (the recovery rewinds
    metrics.jsonl to the checkpoint it resumes from; the log keeps the order)."""
    log = (run_dir.parent / f"{run_dir.name}.log").read_text().splitlines()
    cut = next((i for i, line in enumerate(log) if "recreating the worker groups" in line), len(log))
    steps = [int(line.split("step ")[1].split(":")[0]) for line in log[:cut]
             if "][easytrain.metrics][INFO] - step " in line and "val/" not in line]
    return max(steps, default=0)


def kill_in_save(work: Path, step: int, name: str, *extra: str) -> Outcome:
    """SIGKILL of the driver while a checkpoint is being written (its ``.tmp_`` folder exists), then again."""
    ref = reference(work, *extra)
    run_dir, start = work / name, time.perf_counter()
    run = Run(run_dir, *extra).start()
    wait_for(run, step, extra)
    root = run_dir / "checkpoints"
    deadline = time.monotonic() + 120
    while not (root.is_dir() and any(p.name.startswith(".tmp_") for p in root.iterdir())):  # no folder before
        # the first save
        assert run.proc is not None and run.proc.poll() is None and time.monotonic() < deadline, run.tail()
        time.sleep(0.001)
    writing = [p.name for p in root.iterdir() if p.name.startswith(".tmp_")]
    run.signal_driver(signal.SIGKILL)
    codes = [run.wait()]
    logged = max(steps_of(run_dir, headline(extra)), default=0)
    codes.append(Run(run_dir, *extra).start().wait())
    return judge("sigkill_driver_in_save", run_dir, ref, codes, logged, start, extra, writing=writing)


# ----------------------------------------------------------------------------- easytrain stop on a Ray head

@contextmanager
def ray_head() -> Iterator[dict[str, Any]]:
    """A head node started the way a user starts one (``ray start --head``) with Ray's token authentication on,
    on loopback; stopped (``ray stop --force``: every Ray on this machine) on leaving.

    ``ray start`` turns authentication on only with ``RAY_AUTH_MODE=token`` or when a token already exists
    (``~/.ray/auth_token``, which any earlier local ``ray.init()`` writes), so the head gets its own token file
    and mode explicitly, and this process reads the same file (``RAY_AUTH_TOKEN_PATH``) while the head lives."""
    import secrets
    import sys
    import tempfile

    from easytrain.distributed.group import free_port

    ray = str(Path(sys.executable).with_name("ray"))
    ports = {"gcs": free_port(), "dashboard": free_port(), "metrics": free_port()}
    token_dir = tempfile.TemporaryDirectory(prefix="easytrain-head-")
    token_path = Path(token_dir.name) / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    env = {**os.environ, **auth, "RAY_metrics_report_interval_ms": "1000",  # export every second, not every 10 s
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # the job's `python`
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN", None)
    saved = {name: os.environ.get(name) for name in auth}
    os.environ.update(auth)
    start = [ray, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={ports['gcs']}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
             f"--metrics-export-port={ports['metrics']}", "--num-cpus=8", "--disable-usage-stats"]
    try:
        done = subprocess.run(start, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        yield {"address": f"http://127.0.0.1:{ports['dashboard']}",
               "metrics": f"http://127.0.0.1:{ports['metrics']}/metrics", "env": env}
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True, timeout=120)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        token_dir.cleanup()


def stop_mid_step(work: Path, step: int, delay: float, name: str, address: str) -> Outcome:
    """``easytrain stop`` of a run submitted to a Ray head, ``delay`` seconds after ``step`` was logged: the step
    in flight finishes and is saved (0 steps lost); submitted again, the run ends as the uninterrupted one."""
    import io

    from easytrain.launch import jobs

    ref = reference(work)
    run_dir, start = work / name, time.perf_counter()
    overrides = Run(run_dir).args[3:]
    log = work / f"{name}.log"

    def submitted() -> str:
        out = io.StringIO()
        assert jobs.submit(overrides, address, working_dir=str(ROOT), out=out) == 0, out.getvalue()
        return out.getvalue().splitlines()[0].split()[-1]

    def ended(job: str, status: str) -> int:
        with open(log, "a") as f:
            jobs.logs(job, address, out=f)
        return {"SUCCEEDED": 0, "STOPPED": 143}.get(status, 1)

    job = submitted()
    deadline = time.monotonic() + 300
    while step not in steps_of(run_dir):
        assert str(jobs.client(address).get_job_status(job).value) not in jobs.TERMINAL, "the job ended early"
        assert time.monotonic() < deadline, f"step {step} not reached"
        time.sleep(0.02)
    time.sleep(delay)
    jobs.stop(job, address, out=io.StringIO())
    codes = [ended(job, jobs.wait_for(job, address, timeout=300, poll=0.2))]
    logged = max(steps_of(run_dir), default=0)
    latest = run_dir / "checkpoints" / "latest"
    saved = int(latest.read_text()) if latest.exists() else 0
    job = submitted()
    codes.append(ended(job, jobs.wait_for(job, address, timeout=600, poll=0.5)))
    outcome = judge("easytrain_stop", run_dir, ref, codes, logged, start, log=log, after_step=step,
                    delay_s=round(delay, 3), saved_at_stop=saved)
    outcome.steps_lost = logged - saved  # the step in flight is finished and saved: none
    return outcome


# ----------------------------------------------------------------------------- storage

def full_disk(work: Path, name: str, size_mb: int = 64) -> Optional[Outcome]:
    """The run folder on a small tmpfs filled up after step 2: the save that finds no room ends the run in one
    line (exit 3), the checkpoint before it intact; once room is made, the same command resumes. None where
    this process may not mount a tmpfs (not root)."""
    ref = reference(work)
    mount = work / f"{name}-disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        return None
    start = time.perf_counter()
    try:
        run_dir = mount / "run"
        run = Run(run_dir)
        run.log = work / f"{name}.log"  # the log stays readable off the full disk
        run.start()
        wait_for(run, 2, ())
        filler = mount / "filler"
        for _ in range(100):  # the run writes as we fill: leave about 1 MB, less than a checkpoint
            try:
                with open(filler, "ab") as f:
                    os.posix_fallocate(f.fileno(), 0, f.tell() + shutil.disk_usage(mount).free - 2**20)
                break
            except OSError:
                continue
        codes = [run.wait()]
        log = run.log.read_text()
        failed = next((line for line in log.splitlines() if line.startswith("easytrain: run failed: the checkpoint")),
                      "")
        root = run_dir / "checkpoints"
        intact = (root / "latest").read_text().strip() if (root / "latest").exists() else ""
        half_written = [p.name for p in root.iterdir() if p.name.startswith(".tmp_")]
        logged = max(steps_of(run_dir), default=0)
        filler.unlink()
        rerun = Run(run_dir)
        rerun.log = run.log
        codes.append(rerun.start().wait())
        kept = work / name
        shutil.copytree(run_dir, kept)
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
    outcome = judge("full_disk_in_save", kept, ref, codes, logged, start, log=run.log, one_line_error=failed[:200],
                    latest_when_full=intact, half_written_left=half_written)
    outcome.recovered = outcome.recovered and codes[0] == 3 and bool(failed) and not half_written
    return outcome


def truncated_checkpoint(work: Path, name: str) -> Outcome:
    """The latest checkpoint's largest shard cut in half after the driver died: the run, started again, falls
    back to the checkpoint before it."""
    ref = reference(work)
    run_dir, start = work / name, time.perf_counter()
    run = Run(run_dir).start()
    wait_for(run, 3, ())
    root = run_dir / "checkpoints"
    deadline = time.monotonic() + 120
    while not ((root / "latest").exists() and (root / "latest").read_text().strip() == "3"):
        assert time.monotonic() < deadline, run.tail()
        time.sleep(0.01)
    run.signal_driver(signal.SIGKILL)
    codes = [run.wait()]
    logged = max(steps_of(run_dir), default=0)
    latest = root / f"global_step_{(root / 'latest').read_text().strip()}"
    shard = max((latest / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    codes.append(Run(run_dir).start().wait())
    return judge("truncated_latest_checkpoint", run_dir, ref, codes, logged, start, truncated=str(shard.relative_to(run_dir)))


def prompts_file(work: Path) -> Path:
    """A parquet file of 16 synthetic prompts in ``work`` (written once)."""
    data = work / "prompts.parquet"
    if not data.exists():
        import pyarrow as pa
        import pyarrow.parquet as pq

        from easytrain.data.synthetic import generate

        rows = [{k: row[k] for k in ("images", "problem", "answer")} for row in generate(16, seed=0)]
        pq.write_table(pa.Table.from_pylist(rows), data)
    return data


def dataset_removed(work: Path, name: str, exact: bool = True) -> Outcome:
    """The training file deleted after step 2 of a run reading a parquet file: the run goes on (the rows were
    read at the start) and ends as the uninterrupted run of that file (``exact``; else: every step once and
    finite weights, without the reference run)."""
    data = prompts_file(work)
    copy = work / f"{name}.parquet"
    shutil.copy(data, copy)
    ref = reference(work, f"data.train_files={data}") if exact else data
    run_dir, start = work / name, time.perf_counter()
    run = Run(run_dir, f"data.train_files={copy}").start()
    wait_for(run, 2, ())
    copy.unlink()
    codes = [run.wait()]
    return judge("dataset_file_removed", run_dir, ref, codes, 0, start, (f"data.train_files={data}",), exact=exact,
                 rows_only=True)


# ----------------------------------------------------------------------------- rewards

def faulty_reward(work: Path, modes: tuple[str, ...], name: str, remove_data: bool = False) -> Outcome:
    """The reward function raises, hangs (reward.timeout_s=3) or returns NaN (``modes``, one per step from step
    3 on: a command file the first reward worker to score claims). The run ends, every step logged once, the
    bad responses scored 0 and counted in reward/error_rate, the weights finite. ``remove_data``: the run reads a
    parquet copy of :func:`prompts_file`, deleted after step 2 (:func:`dataset_removed`'s fault, in this run)."""
    ref = reference(work)
    run_dir, start = work / name, time.perf_counter()
    commands = work / f"{name}-commands"
    commands.mkdir()
    args = [f"reward.function={FAULTY}:spread", "reward.timeout_s=3"]
    copy = work / f"{name}.parquet"
    if remove_data:
        shutil.copy(prompts_file(work), copy)
        args.append(f"data.train_files={copy}")
    run = Run(run_dir, *args, env={"EASYTRAIN_TEST_FAULT": str(commands)}).start()
    for step, mode in enumerate(modes, start=2):
        wait_for(run, step, ())
        if remove_data and step == 2:
            copy.unlink()
        (commands / mode).write_text("1" if mode == "hangs" else "9")  # a call and its 8 retries one by one
    codes = [run.wait()]
    claimed = sorted(p.name.split(".")[0] for p in commands.iterdir() if ".taken." in p.name)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    errors = [r.get("reward/error_rate", 0.0) for r in records if "reward/mean" in r]
    removed = {"train_file_removed_after_step": 2} if remove_data else {}
    outcome = judge("reward_" + "_".join(modes), run_dir, ref, codes, 0, start, exact=False, claimed=claimed,
                    reward_errors_per_step=errors, **removed)
    outcome.recovered = outcome.recovered and claimed == sorted(modes) and sum(e > 0 for e in errors) == len(modes)
    return outcome


# ----------------------------------------------------------------------------- memory rising inside a step

def memory_in_step(work: Path, name: str, rng: random.Random, control: bool = False) -> Outcome:
    """Ray's memory monitor armed at 3 GB above what the node will hold with the run at its peak (the node's use
    now plus the summed RSS the uninterrupted run's processes peaked at); the watchdog's hard threshold 1.5 GB
    above it. At a random step (2-4) a reward worker grows its memory at 0.5-1.5 GB/s towards 6 GB: past Ray's
    line, Ray would kill it. The watchdog must stop the step first (exit 4, nothing
    of the step trained), save the step before, and the same command must then end as the uninterrupted run.
    ``control``: the same with the watchdog off, to show Ray's monitor really kills at that line."""
    watch = MEMORY_WATCH
    from easytrain.memory.readings import node_ram
    from pressure_harness import run_peak

    ref = reference(work, *watch)
    now = node_ram(None)
    peak, total = now["ram_used_bytes"] + run_peak(ref), now["ram_total_bytes"]
    kill_line, hard = (peak + 3.0 * GB) / total, (peak + 1.5 * GB) / total
    levels = (f"watchdog.ram_hard={hard:.4f}", f"watchdog.ram_soft={hard - 0.002:.4f}",
              f"watchdog.ram_warn={hard - 0.004:.4f}")
    step, rate_mb_s = rng.randint(2, 4), rng.uniform(512, 1536)
    run_dir, start = work / name, time.perf_counter()
    ballast = work / f"{name}-ballast"
    ballast.mkdir()
    env = {"EASYTRAIN_TEST_BALLAST": str(ballast), "RAY_memory_usage_threshold": f"{kill_line:.4f}",
           "RAY_memory_monitor_refresh_ms": "250"}
    args = (*watch, *levels, *(("watchdog.enabled=false",) if control else ()))
    run = Run(run_dir, *args, env=env).start()
    wait_for(run, step - 1, ())
    (ballast / "grow_mb").write_text(f"6144 {rate_mb_s:.0f}")  # the next reward call (step `step`) claims it
    codes = [run.wait()]
    log = run.log.read_text()
    logged = max(steps_of(run_dir), default=0)
    hard_events = []
    if (run_dir / "memory.jsonl").exists():
        hard_events = [r for r in map(json.loads, (run_dir / "memory.jsonl").read_text().splitlines())
                       if r.get("kind") == "event" and r.get("level") == "hard"]
    detail = {"grow_at_step": step, "grow_mb_per_s": round(rate_mb_s), "ray_kill_line": round(kill_line, 4),
              "ram_hard": round(hard, 4), "killed_by_ray": any(text in log for text in ("memory monitor", "OutOfMemoryError", "low on memory")),
              "caught_at": [(e["step"], e.get("phase")) for e in hard_events], "reaction_s": reaction(run_dir)}
    if control:
        return Outcome("memory_in_step_control", codes[0] == 0, 0, codes[0] != 0, round(time.perf_counter() - start, 1),
                       {"exit_codes": codes, **detail})
    if codes[0] == EXIT_MEMORY:
        codes.append(Run(run_dir, *args).start().wait())
    outcome = judge("memory_in_step", run_dir, ref, codes, logged, start, watch, **detail)
    outcome.recovered = outcome.recovered and codes[0] == EXIT_MEMORY and not detail["killed_by_ray"]
    return outcome


def reaction(run_dir: Path) -> Optional[float]:
    """Seconds from the first node sample at the hard level to the driver's stop (its hard event: the reward
    workers are killed right after it): the part of what REACTION_S in easytrain/memory/flag.py stands for
    that a run can see (the rest is the killed process's exit)."""
    path = run_dir / "memory.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines()]
    hard_at = next((r["t"] for r in records if r.get("kind") == "node" and "ram_hard" in r
                    and r["ram_fraction"] >= r["ram_hard"]), None)
    stop_at = next((r["t"] for r in records if r.get("kind") == "event" and r.get("level") == "hard"), None)
    return None if hard_at is None or stop_at is None else round(stop_at - hard_at, 3)
