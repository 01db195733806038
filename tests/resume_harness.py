"""Runs of ``python -m easytrain.main`` in their own process (and their own local Ray) that a test or the
kill-and-resume bench interrupts: SIGKILL of a worker or of the driver, SIGTERM of the driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
REWARD = ROOT / "tests" / "assets" / "spread_reward.py"
STEPS = 6

RUN_ARGS = ["+exp=tiny", f"trainer.max_steps={STEPS}", "trainer.save_freq=1", "trainer.val_before_train=false",
            "data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "worker.rollout.n=4",
            "worker.actor.micro_batch_size_per_device_for_update=8", "data.synthetic_size=16",
            "data.synthetic_val_size=8", "data.max_response_length=3", f"reward.function={REWARD}:spread",
            "trainer.memory_check=off", "ray.include_dashboard=false"]
"""6 steps over 16 prompts in batches of 4 (so the data order crosses an epoch), a checkpoint every step,
and a reward that spreads scores so every step changes the weights."""


class Run:
    def __init__(self, run_dir: Path, *extra: str, env: Optional[dict[str, str]] = None) -> None:
        """``extra`` overrides are added to RUN_ARGS (one naming a RUN_ARGS key replaces it)."""
        self.run_dir = run_dir
        keys = {arg.split("=", 1)[0] for arg in extra}
        base = [arg for arg in RUN_ARGS if arg.split("=", 1)[0] not in keys]
        self.args = [sys.executable, "-m", "easytrain.main", *base, *extra, f"hydra.run.dir={run_dir}"]
        self.log = run_dir.parent / f"{run_dir.name}.log"
        self.env = env or {}
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "Run":
        env = {**os.environ, **self.env}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(self.args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait(self, timeout: float = 600) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.reap()

    def wait_for_step(self, step: int, timeout: float = 300) -> None:
        """Until metrics.jsonl holds a training record of ``step`` (the step is done, its checkpoint may not be)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, f"run exited early:\n{self.tail()}"
            if step in logged_steps(self.run_dir):
                return
            time.sleep(0.05)
        raise TimeoutError(f"step {step} not reached in {timeout} s:\n{self.tail()}")

    def wait_for_logged(self, step: int, resumed: int, timeout: float = 300) -> None:
        """Until the run log holds ``step``'s training line after its ``resumed``-th "resumed from" line (the log of
        the folder: every run of it; metrics.jsonl is rewound on each resume, the log keeps the order)."""
        deadline = time.monotonic() + timeout
        while True:
            seen = 0
            for line in self.log.read_text().splitlines() if self.log.exists() else []:
                if "resumed from " in line:
                    seen += 1
                elif seen >= resumed and f"][easytrain.metrics][INFO] - step {step}:" in line and "val/" not in line:
                    return
            assert self.proc is not None and self.proc.poll() is None, f"run exited early:\n{self.tail()}"
            assert time.monotonic() < deadline, f"step {step} not reached after {resumed} resume(s):\n{self.tail()}"
            time.sleep(0.02)

    def descendants(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill_worker(self, title: str = "ray::FusedWorker") -> int:
        """SIGKILL one worker process of the run (found by its Ray process title); returns its pid."""
        for child in self.descendants():
            try:
                if title in " ".join(child.cmdline()):
                    child.send_signal(signal.SIGKILL)
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no process titled {title!r} under the driver")

    def signal_driver(self, signum: int) -> None:
        assert self.proc is not None
        self._left = self.descendants()  # Ray's processes share the driver's fate; make sure in reap()
        self.proc.send_signal(signum)

    def reap(self) -> None:
        """Kill whatever the run left behind (nothing, normally: Ray's processes die with the driver)."""
        for child in getattr(self, "_left", []) + self.descendants():
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text().splitlines()[-lines:]) if self.log.exists() else ""


def run_in_process(run_dir: Path, *extra: str) -> Path:
    """The run ``Run(run_dir, *extra)`` makes, uninterrupted, made by a trainer in this process on the Ray it is
    connected to: the same config (easytrain.main's ``resolve``), steps, data order and weights as the command, at
    a trainer's cost instead of a process and a Ray of its own. For reference runs only: what is judged is still
    the command."""
    from easytrain.config import compose
    from easytrain.main import resolve

    keys = {arg.split("=", 1)[0] for arg in extra}
    args = [arg for arg in RUN_ARGS if arg.split("=", 1)[0] not in keys]
    config = resolve(compose([*args, *extra, f"trainer.output_dir={run_dir}"]))
    if config.trainer.task == "sft":
        from easytrain.trainer.sft import SFTTrainer as Trainer
    else:
        from easytrain.trainer.rl import RLTrainer as Trainer  # type: ignore[assignment]
    trainer = Trainer(config)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return run_dir


def logged_steps(run_dir: Path) -> list[int]:
    """Steps with a training record in metrics.jsonl, in file order (validation records excluded)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "reward/mean" in record:
            steps.append(record["step"])
    return steps


def data_order(run_dir: Path) -> list[list[str]]:
    path = run_dir / "data_order.jsonl"
    return [json.loads(line)["uids"] for line in path.read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The actor's weights in the run's latest checkpoint, loaded into a plain model."""
    from easytrain.distributed.checkpoint import load_model_weights
    from easytrain.models.hf import load_model, model_folder
    from easytrain.trainer.checkpoint import ACTOR, checkpoint_folder
    from easytrain.trainer.export import checkpoint_config

    folder = checkpoint_folder(run_dir)
    config = checkpoint_config(folder)
    model = load_model(config.model, model_folder(config.model), dtype="float32")
    load_model_weights(folder / ACTOR, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
