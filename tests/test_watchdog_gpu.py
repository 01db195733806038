"""The watchdog's GPU judgement on readings recorded on a real GPU (issue 23, item 3).

tests/assets/gpu_readings.json was written by ``bench/gpu_readings.py`` on an H200: two processes sharing the
GPU as a colocated run's do (an engine with a KV pool reserved up front, a trainer whose activations change
size from step to step), NVML's "used" sampled while each step ran, and each process's allocator at the step
boundary; once healthy, once with the trainer keeping 3% of the device alive every step. The watchdog judges a
GPU by what its processes hold (:func:`easytrain.memory.detect.gpu_pressure`), not by NVML's "used"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from easytrain.config import load
from easytrain.memory.detect import MB, LeakDetector, gpu_pressure, level

RECORDING = json.loads((Path(__file__).parent / "assets" / "gpu_readings.json").read_text())
UUID = "GPU-5f3c0000-0000-0000-0000-000000000000"  # the recording's one GPU, as NVML names it


def _step(step: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A recorded step as the watchdog receives it: the sampler's gpu records, the workers' readings."""
    samples = [{"kind": "gpu", "node_ip": "10.0.0.1", "index": 0, "uuid": UUID, **s} for s in step["gpu_samples"]]
    samples.append({"kind": "gpu", "node_ip": "10.0.0.1", "index": 0, "uuid": UUID, "t": samples[-1]["t"] + 0.01,
                    **step["boundary"]})
    workers = [{**w, "node_ip": "10.0.0.1", "gpu_uuid": UUID[4:].upper()} for w in step["workers"]]  # torch's form
    return samples, workers


def _levels(scenario: str) -> tuple[list[str], list[str], list[float]]:
    cfg = load([]).watchdog
    thresholds = (cfg.vram_warn, cfg.vram_soft, cfg.vram_hard)
    nvml, held, fractions = [], [], []
    for step in RECORDING[scenario]:
        samples, workers = _step(step)
        (gpu,) = gpu_pressure(samples, workers)
        assert gpu["basis"] == "held"
        nvml.append(level(gpu["used_bytes"] / gpu["total_bytes"], *thresholds))
        held.append(level(gpu["fraction"], *thresholds))
        fractions.append(gpu["fraction"])
    return nvml, held, fractions


def test_a_healthy_colocated_step_reads_full_on_nvml_but_holds_far_less() -> None:
    nvml, held, fractions = _levels("healthy")
    assert "hard" in nvml  # judged by NVML's "used" the run would have been checkpointed and stopped
    assert held == ["ok"] * len(held)
    assert max(fractions) < 0.8


def test_a_leak_grows_what_the_gpu_holds_step_by_step_until_it_is_pressure() -> None:
    _, held, fractions = _levels("leak")
    assert all(b > a for a, b in zip(fractions, fractions[1:]))  # every step holds more
    assert held[0] == "ok" and held[-1] in ("soft", "hard")
    healthy = _levels("healthy")[2]  # both scenarios' activations grow a little each step, by design
    growth = (fractions[-1] - fractions[0] - healthy[-1] + healthy[0]) / (len(fractions) - 1)
    assert growth == pytest.approx(RECORDING["settings"]["leak_fraction"], rel=0.05)  # the 3% it keeps


@pytest.mark.parametrize("scenario, leaks", [("healthy", False), ("leak", True)])
def test_the_leak_detector_sees_the_allocated_bytes_grow_only_in_the_leak(scenario: str, leaks: bool) -> None:
    detector = LeakDetector(warmup=0, window=8, min_points=6)  # the recording has 8 steps, not the default's 24+
    for step in RECORDING[scenario]:
        for w in step["workers"]:
            detector.observe(step["step"], f"{w['role']} GPU allocated", w["gpu_allocated_bytes"])
    found = detector.check()
    assert [key for key, _ in found] == (["leak actor GPU allocated"] if leaks else [])
    if leaks:
        slope = detector.slope_mb("actor GPU allocated")
        assert slope * MB == pytest.approx(RECORDING["settings"]["leak_fraction"] * RECORDING["total_bytes"], rel=0.05)


def test_a_gpu_without_worker_readings_is_judged_by_nvml() -> None:
    samples, _ = _step(RECORDING["healthy"][3])
    (gpu,) = gpu_pressure(samples, [])
    assert gpu["basis"] == "nvml" and gpu["held_bytes"] == max(s["used_bytes"] for s in samples)


class ReplayedNvml:
    """NVML as ``gpu_readings`` calls it, answering one GPU's recorded "used" readings in order; once they run
    out it keeps answering the last (a sample the sampler's own thread might take repeats the boundary)."""

    def __init__(self) -> None:
        self.pending: list[dict[str, int]] = []
        self.current: dict[str, int] = {}

    def play(self, readings: list[dict[str, int]]) -> None:
        self.pending = list(readings)

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - NVML's names
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:  # noqa: N802
        return UUID.encode()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        from types import SimpleNamespace

        if self.pending:
            self.current = self.pending.pop(0)
        return SimpleNamespace(used=self.current["used_bytes"], total=self.current["total_bytes"])


class InProcess:
    """A sampler in this process answering as its Ray actor handle does (``handle.method.remote(...)``)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __getattr__(self, name: str) -> Any:
        import ray
        from types import SimpleNamespace

        method = getattr(self.sampler, name)
        return SimpleNamespace(remote=lambda *args, **kwargs: ray.put(method(*args, **kwargs)))


@pytest.mark.parametrize("scenario", ["healthy", "leak"])
def test_recorded_gpu_readings_through_the_samplers_collection_are_judged_as_on_the_gpu(
        ray_local: None, tmp_path: Path, scenario: str) -> None:
    """The recorded steps go the whole way a run's readings go: NVML read by the node sampler's own
    ``sample``, buffered, drained at the step boundary (whose sample is the boundary reading), then
    ``Watchdog.collect`` with the workers' allocator readings. Its levels and fractions per step are those the
    recording's own script computed on the GPU (``summary``); ``memory.jsonl`` holds every reading."""
    import ray

    from easytrain.memory.watchdog import NodeSampler, Watchdog

    config = load([f"trainer.output_dir={tmp_path}", "watchdog.sample_period_s=3600"])  # no sample of its own
    dog = Watchdog(config, str(tmp_path))
    nvml = ReplayedNvml()
    (node,) = dog.samplers
    ray.kill(dog.samplers[node])
    sampler = NodeSampler(node, 3600.0, None)
    sampler.nvml = nvml
    dog.samplers[node] = InProcess(sampler)
    summary, levels, held, nvml_max = RECORDING["summary"][scenario], [], [], []
    try:
        for step in RECORDING[scenario]:
            nvml.play([*step["gpu_samples"], step["boundary"]])
            for _ in step["gpu_samples"]:
                sampler.sample()
            workers = [{**w, "node_ip": sampler.node_ip, "gpu_uuid": UUID[4:].upper()} for w in step["workers"]]
            out = dog.collect(step["step"], workers)
            levels.append(out.level)
            held.append(out.metrics["memory/gpu_held_fraction_max"])
            nvml_max.append(out.metrics["memory/gpu_fraction_max"])
            if out.level != "ok":
                assert "vram" in out.resources
                assert any("GPU 0 (held by its processes)" in line for line in out.pressure), out.pressure
    finally:
        sampler.stop()
        dog.samplers.pop(node)  # nothing left for close() to kill
        dog.close(plot=False)
    # RAM is judged too: on this machine it is ok, so the step's level is the GPU's
    assert levels == summary["held_levels"]
    assert held == pytest.approx(summary["held_fraction_per_step"], abs=5e-5)  # the summary's 4 decimals
    assert nvml_max == pytest.approx(summary["nvml_fraction_max_per_step"], abs=5e-4)  # rounded to 3-4
    if scenario == "healthy":
        assert "hard" in summary["nvml_levels"]  # NVML's "used" alone would have stopped this healthy run
    records = [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]
    used = [r["used_bytes"] for r in records if r["kind"] == "gpu"]
    assert used == [s["used_bytes"] for step in RECORDING[scenario]
                    for s in [*step["gpu_samples"], step["boundary"]]]
