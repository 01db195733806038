"""Record, on a real GPU, what the memory watchdog reads in a healthy colocated step and in a leak.

    python bench/gpu_readings.py     # on a CUDA machine -> tests/assets/gpu_readings.json (bench/gpu_smoke.py runs it)

Two processes share the one GPU the way a colocated run's do: an engine process reserves its KV pool up front
(``POOL_FRACTION`` of the device, as vLLM does at ``gpu_memory_utilization``) and then generates, allocating
its transients; a trainer process holds weights and Adam states and runs an update whose activations differ in
size from step to step (responses of different lengths), so its caching allocator keeps blocks of every size it
has seen. Each step, while each phase runs, a thread here reads NVML's "used" every few milliseconds (what the
watchdog's node sampler reads), and at the step boundary each process reports its allocator's allocated,
reserved and peak-since-the-last-boundary bytes (what the workers' ``memory`` readings carry). The leak
scenario is the same with the trainer keeping ``LEAK_FRACTION`` of the device alive every step.

The tests (tests/test_watchdog.py) replay these readings through the watchdog's GPU judgement: the healthy
step reads high on NVML but holds far less; the leak's held bytes grow every step and cross the thresholds.
Nothing here is easytrain's training code: it records the allocator and driver behaviour the watchdog judges.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance  # noqa: E402
from easytrain.memory.detect import gpu_held, level  # noqa: E402
from easytrain.memory.readings import gpu_readings, open_nvml  # noqa: E402

OUT = ROOT / "tests" / "assets" / "gpu_readings.json"
STEPS = 8
POOL_FRACTION = 0.45
"""The engine's KV pool, reserved at start-up."""
STATE_FRACTION = 0.04
"""The trainer's weights, gradients and Adam states."""
ACTIVATION_FRACTION = 0.16
"""The trainer's largest activations in a step; step k's are (0.8 + 0.05 k) of it, in 8 tensors."""
LEAK_FRACTION = 0.03
"""What the leaking trainer keeps alive each step."""
THRESHOLDS = (0.85, 0.90, 0.97)
"""watchdog.vram_warn / vram_soft / vram_hard defaults."""


def _reading() -> dict[str, int]:
    return {"gpu_allocated_bytes": int(torch.cuda.memory_allocated()),
            "gpu_reserved_bytes": int(torch.cuda.memory_reserved()),
            "gpu_step_peak_bytes": int(torch.cuda.max_memory_allocated())}


def _serve(conn: Any, run_step: Any) -> None:
    """A child's command loop: ``("run", step)`` runs ``run_step(step)`` and answers the step; ``"reading"``
    answers the allocator reading and starts a new peak; ``"stop"`` ends it."""
    while True:
        command = conn.recv()
        if command == "stop":
            return
        if command == "reading":
            conn.send(_reading())
            torch.cuda.reset_peak_memory_stats()
            continue
        run_step(command[1])
        torch.cuda.synchronize()
        conn.send(command[1])


def _engine(conn: Any, total: int) -> None:
    torch.cuda.set_device(0)
    pool = torch.empty(int(POOL_FRACTION * total), dtype=torch.uint8, device="cuda")
    weights = torch.empty(int(0.01 * total), dtype=torch.uint8, device="cuda")

    def generate(step: int) -> None:  # transients of a fixed size (the batch shape does not change)
        work = [torch.ones(int(0.002 * total) // 4, device="cuda") for _ in range(4)]
        del work

    _serve(conn, generate)
    del pool, weights


def _trainer(conn: Any, total: int, leak: bool) -> None:
    torch.cuda.set_device(0)
    state = torch.zeros(int(STATE_FRACTION * total) // 4, device="cuda")
    kept = []

    def update(step: int) -> None:
        size = int(ACTIVATION_FRACTION * total * (0.8 + 0.05 * step)) // 8 // 4
        activations = [torch.ones(size, device="cuda") for _ in range(8)]
        state.add_(activations[0][: state.numel()].sum() * 0)  # a use of them
        torch.cuda.synchronize()
        del activations
        if leak:
            kept.append(torch.ones(int(LEAK_FRACTION * total) // 4, device="cuda"))

    _serve(conn, update)


class NvmlSampler:
    """Every ``period_s``, in a thread: NVML's used bytes of GPU 0 (``used_bytes``, ``total_bytes``) and of every
    GPU (``used_per_gpu``), with the time. Without NVML (``nvml`` None) it samples nothing."""

    def __init__(self, nvml: Any, period_s: float = 0.003) -> None:
        self.nvml, self.period_s, self.samples, self.stop = nvml, period_s, [], threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while self.nvml is not None and not self.stop.is_set():
            gpus = gpu_readings(self.nvml)
            self.samples.append({"t": time.time(), "used_bytes": gpus[0]["used_bytes"],
                                 "total_bytes": gpus[0]["total_bytes"], "used_per_gpu": [g["used_bytes"] for g in gpus]})
            self.stop.wait(self.period_s)

    def __enter__(self) -> "NvmlSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


def scenario(leak: bool, total: int, nvml: Any) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    pipes = {}
    procs = []
    for role, target, args in (("rollout", _engine, ()), ("actor", _trainer, (leak,))):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, total, *args), daemon=True)
        proc.start()
        pipes[role], procs = parent, procs + [proc]
    steps = []
    try:
        for step in range(STEPS):
            with NvmlSampler(nvml) as sampler:
                for role in ("rollout", "actor"):  # generation, then the update
                    pipes[role].send(("run", step))
                    pipes[role].recv()
            workers = []
            for role in ("rollout", "actor"):
                pipes[role].send("reading")
                workers.append({"role": role, "rank": 0, **pipes[role].recv()})
            boundary = gpu_readings(nvml)[0]
            steps.append({"step": step, "gpu_samples": sampler.samples[:: max(1, len(sampler.samples) // 50)],
                          "boundary": {"used_bytes": boundary["used_bytes"], "total_bytes": boundary["total_bytes"]},
                          "workers": workers})
    finally:
        for role in pipes:
            pipes[role].send("stop")
        for proc in procs:
            proc.join(timeout=30)
    return steps


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    nvml = [max(s["used_bytes"] for s in step["gpu_samples"] + [step["boundary"]]) / step["boundary"]["total_bytes"]
            for step in steps]
    held = [gpu_held(step["boundary"]["used_bytes"], step["workers"]) / step["boundary"]["total_bytes"]
            for step in steps]
    return {"nvml_fraction_max_per_step": [round(f, 4) for f in nvml], "held_fraction_per_step": [round(f, 4) for f in held],
            "nvml_levels": [level(f, *THRESHOLDS) for f in nvml], "held_levels": [level(f, *THRESHOLDS) for f in held]}


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_readings: needs a CUDA device (nothing written)")
    nvml = open_nvml()
    if nvml is None:
        sys.exit("gpu_readings: NVML is not available (pip install nvidia-ml-py)")
    total = gpu_readings(nvml)[0]["total_bytes"]
    record: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "total_bytes": total,
                              "settings": {"pool_fraction": POOL_FRACTION, "state_fraction": STATE_FRACTION,
                                           "activation_fraction": ACTIVATION_FRACTION, "leak_fraction": LEAK_FRACTION,
                                           "steps": STEPS}}
    for name, leak in (("healthy", False), ("leak", True)):
        record[name] = scenario(leak, total, nvml)
        print(name, json.dumps(summary(record[name])), flush=True)
    record["summary"] = {name: summary(record[name]) for name in ("healthy", "leak")}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({**provenance(), **record}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
