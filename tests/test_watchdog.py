"""The watchdog's parts: levels, imbalance and leak detection on constructed series, node and cgroup
readings, NVML-shaped GPU readings, relief that frees real memory, the samplers on a real Ray, validation."""

from __future__ import annotations

import ctypes
import random
import threading
import time
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from easytrain.config.loader import load
from easytrain.config import ConfigError, validate
from easytrain.memory.detect import MB, LeakDetector, RankMemory, imbalance, level, theil_sen_slope, worst
from easytrain.memory.readings import cgroup_memory, gpu_readings, node_ram, release_process_memory

GB = 2**30


# ----------------------------------------------------------------------------- levels


def test_levels_are_the_highest_threshold_reached() -> None:
    assert [level(f, 0.8, 0.85, 0.92) for f in (0.5, 0.8, 0.849, 0.85, 0.919, 0.92, 1.0)] == \
        ["ok", "warn", "warn", "soft", "soft", "hard", "hard"]
    assert worst(["ok", "soft", "warn"]) == "soft"
    assert worst([]) == "ok"


# ----------------------------------------------------------------------------- imbalance


def test_imbalance_names_the_rank_out_of_line_with_its_role() -> None:
    readings = [RankMemory("actor", r, f"10.0.0.{r // 4}", 10 * GB) for r in range(8)]
    readings[5] = RankMemory("actor", 5, "10.0.0.1", 17 * GB)
    readings += [RankMemory("rollout", r, "10.0.0.0", 30 * GB) for r in range(8)]  # another role: its own median
    reports = [text for _, text in imbalance(readings, 1.5)]
    assert len(reports) == 1
    assert reports[0].startswith("actor rank 5 on node 10.0.0.1 holds 17408 MB RSS, 1.7x the median of its 8 ranks")
    assert "uneven batches" in reports[0] and "gathered" in reports[0] and "device_map" in reports[0]


def test_imbalance_stays_quiet_on_even_ranks_and_single_ranks() -> None:
    rng = random.Random(0)
    even = [RankMemory("actor", r, "n", int(10 * GB * rng.uniform(0.9, 1.1))) for r in range(8)]
    assert imbalance(even, 1.5) == []
    assert imbalance([RankMemory("ref", 0, "n", 50 * GB)], 1.5) == []
    two = [RankMemory("actor", 0, "n", 10 * GB), RankMemory("actor", 1, "n", 25 * GB)]  # median 17.5: 1.43x
    assert imbalance(two, 1.5) == []
    assert len(imbalance(two, 1.4)) == 1


# ----------------------------------------------------------------------------- leaks


def feed(detector: LeakDetector, values_mb: list[float], name: str = "actor rank 0 RSS") -> list[str]:
    reports = []
    for step, value in enumerate(values_mb, start=1):
        detector.observe(step, name, value * MB)
        reports += [text for _, text in detector.check()]
    return reports


def test_steady_growth_is_reported_once_with_its_slope() -> None:
    rng = random.Random(1)
    growing = [2000 + 50 * s + rng.gauss(0, 8) for s in range(40)]
    reports = feed(LeakDetector(warmup=5, threshold_mb=20), growing)
    assert len(reports) == 1
    slope = float(reports[0].split(" grows ")[1].split(" MB/step")[0])
    assert 45 < slope < 55, reports
    assert reports[0].startswith("actor rank 0 RSS grows")
    noisy_leak = [700 + 30 * s + rng.uniform(-60, 60) for s in range(60)]  # a leak under allocator noise
    assert len(feed(LeakDetector(), noisy_leak)) == 1


def test_flat_noisy_and_one_jump_series_are_not_leaks() -> None:
    rng = random.Random(2)
    flat = [4000 + rng.gauss(0, 30) for _ in range(60)]
    assert feed(LeakDetector(), flat) == []
    # an actor's per-step RSS as the default run shows it: a plateau wandering by +-100 MB
    for seed in range(20):
        wander = random.Random(seed)
        assert feed(LeakDetector(), [780 + wander.uniform(-100, 100) for _ in range(200)]) == [], seed
    jump = [3000.0] * 10 + [3800.0] * 40  # a cache filling once after warm-up
    assert feed(LeakDetector(), jump) == []
    # a node's RAM as the default run's shows it: Ray's object store and the rest of the node rising ~0.5 GB
    # over 8-12 steps and falling back, with noise (a 16-step window took one such rise for a leak)
    for seed in range(20):
        saw = random.Random(seed)
        cycles = [3600 + 500 * min(i % 16, 16 - i % 16) / 8 * (i % 16 < 12) + saw.gauss(0, 30) for i in range(200)]
        assert feed(LeakDetector(), cycles) == [], seed
    warmup_only = [1000 + 300 * min(s, 5) for s in range(40)]  # grows only during the warm-up steps
    assert feed(LeakDetector(warmup=5), warmup_only) == []
    resumed = LeakDetector(warmup=5)  # a resumed run starting at step 100 warms up again
    for step in range(100, 105):
        resumed.observe(step, "x", 1000 * MB + step * 300 * MB)
    assert resumed.series == {}
    resumed.observe(105, "x", 1000 * MB)
    assert resumed.series == {"x": [(105, 1000 * MB)]}
    slow = [2000 + 5 * s for s in range(40)]  # real but below the threshold
    assert feed(LeakDetector(threshold_mb=20), slow) == []


def test_theil_sen_ignores_an_outlier() -> None:
    values = [float(2 * i) for i in range(11)]
    values[5] = 500.0
    assert theil_sen_slope(list(range(11)), values) == pytest.approx(2.0)


# ----------------------------------------------------------------------------- readings


def test_node_ram_matches_psutil_and_honours_a_configured_limit() -> None:
    reading = node_ram()
    vm = psutil.virtual_memory()
    assert reading["ram_total_bytes"] == vm.total
    assert abs(reading["ram_used_bytes"] - (vm.total - vm.available)) < 512 * MB
    limited = node_ram(limit_bytes=8 * GB)
    assert limited["ram_limit_bytes"] == 8 * GB and limited["source"] == "config"
    assert limited["ram_fraction"] == pytest.approx(limited["ram_used_bytes"] / (8 * GB))


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cgroup_limit_wins_when_tighter(tmp_path: Path, version: str) -> None:
    """A KubeRay pod's limit (recorded cgroup files of both versions): working set = usage - inactive file."""
    if version == "v2":
        (tmp_path / "memory.max").write_text("4294967296\n")
        (tmp_path / "memory.current").write_text("3221225472\n")
        (tmp_path / "memory.stat").write_text("anon 2147483648\ninactive_file 1073741824\nactive_file 5\n")
    else:
        v1 = tmp_path / "memory"
        v1.mkdir()
        (v1 / "memory.limit_in_bytes").write_text("4294967296\n")
        (v1 / "memory.usage_in_bytes").write_text("3221225472\n")
        (v1 / "memory.stat").write_text("cache 5\ntotal_inactive_file 1073741824\n")
    assert cgroup_memory(tmp_path) == (2 * GB, 4 * GB)
    reading = node_ram(cgroup_root=tmp_path)
    assert reading["source"] == "cgroup" and reading["ram_limit_bytes"] == 4 * GB
    assert reading["ram_fraction"] == pytest.approx(0.5)


def test_cgroup_without_a_limit_falls_back_to_the_host(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000\n")
    assert cgroup_memory(tmp_path) is None
    assert node_ram(cgroup_root=tmp_path)["source"] == "host"


MemoryInfo = namedtuple("MemoryInfo", "total free used")  # the shape nvmlDeviceGetMemoryInfo returns


class RecordedNVML:
    """NVML's three calls answering with readings recorded on a 2 x 80 GB node (no GPU here)."""

    def __init__(self, used: list[int], total: int = 85_899_345_920) -> None:
        self.used, self.total = used, total

    def nvmlDeviceGetCount(self) -> int:
        return len(self.used)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> MemoryInfo:
        return MemoryInfo(self.total, self.total - self.used[handle], self.used[handle])

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:  # older nvidia-ml-py answers bytes, newer str
        return f"GPU-0000000{handle}-1111-2222-3333-444444444444".encode()


def test_gpu_readings_from_nvml_shaped_answers() -> None:
    readings = gpu_readings(RecordedNVML([10_737_418_240, 79_456_894_976]))
    assert [r["index"] for r in readings] == [0, 1]
    assert readings[1]["uuid"] == "GPU-00000001-1111-2222-3333-444444444444"
    assert readings[0]["fraction"] == pytest.approx(0.125)
    assert readings[1]["fraction"] == pytest.approx(0.925)
    assert level(readings[1]["fraction"], 0.85, 0.90, 0.97) == "soft"


def test_release_frees_glibc_retained_heap_and_reports_what_rss_shows() -> None:
    """Freed-but-retained heap (blocks under a live one) comes back with malloc_trim; measured, not claimed."""
    ctypes.CDLL("libc.so.6")  # glibc is what this machine runs
    pinned = []

    def fragment() -> None:
        blocks = [bytearray(64 * 1024) for _ in range(4096)]  # 256 MB
        pinned.append(bytearray(64 * 1024))
        del blocks

    thread = threading.Thread(target=fragment)
    thread.start()
    thread.join()
    before = psutil.Process().memory_info().rss
    result = release_process_memory()
    after = psutil.Process().memory_info().rss
    assert result["ram_freed_bytes"] > 200 * MB
    assert abs((before - after) - result["ram_freed_bytes"]) < 32 * MB


# ----------------------------------------------------------------------------- validation


def test_thresholds_are_validated_against_each_other_and_rays_kill_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"watchdog.ram_soft=0.95: must be below watchdog.ram_hard=0.9"):
        validate(load(["watchdog.ram_soft=0.95", "watchdog.ram_hard=0.9"]))
    with pytest.raises(ConfigError, match=r"watchdog.vram_warn=0.95: must not exceed watchdog.vram_soft"):
        validate(load(["watchdog.vram_warn=0.95"]))
    with pytest.raises(ConfigError, match=r"watchdog.ram_hard=0.96: must stay below Ray's memory kill threshold 0.95"):
        validate(load(["watchdog.ram_soft=0.9", "watchdog.ram_hard=0.96"]))
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.9")
    with pytest.raises(ConfigError, match=r"watchdog.ram_hard=0.92: .* threshold 0.9 "):
        validate(load([]))
    monkeypatch.delenv("RAY_memory_usage_threshold")
    with pytest.raises(ConfigError, match=r"watchdog.actions='drop_everything': not a relief action"):
        validate(load(["watchdog.actions=[free_caches,drop_everything]"]))
    validate(load(["watchdog.ram_limit_gb=4", "watchdog.ram_soft=0.96", "watchdog.ram_hard=0.99"]))
    with pytest.raises(ConfigError, match=r"watchdog.ram_scope='run': .* set watchdog.ram_limit_gb"):
        validate(load(["watchdog.ram_scope=run"]))
    with pytest.raises(ConfigError, match=r"watchdog.ram_scope='process': .*node, run"):
        validate(load(["watchdog.ram_scope=process"]))
    validate(load(["watchdog.ram_scope=run", "watchdog.ram_limit_gb=4"]))


# ----------------------------------------------------------------------------- the planner's advice at a stop


def advice(overrides: list[str], metrics: dict[str, float]) -> str:
    from easytrain.trainer.relief import MemoryGuard

    guard = MemoryGuard.__new__(MemoryGuard)  # planner_fixes needs only the config: no samplers, no Ray
    guard.config = load(overrides)
    return guard.planner_fixes(metrics)


def test_the_stop_asks_the_planner_for_the_side_under_pressure() -> None:
    host = advice(["+exp=qwen25vl_7b"], {"memory/node_ram_fraction_max": 0.93})
    # bring offloaded states back to the GPUs (the reference's first: the actor's no longer fits with the device
    # margin recorded on a GPU)
    assert host.startswith("config changes that lower the peak (easytrain plan): worker.ref.offload.params=false")
    assert "worker.actor.offload.params=false" in host
    assert "host per node" in host
    device = advice(["+exp=qwen25vl_7b"], {"memory/node_ram_fraction_max": 0.5, "memory/gpu_fraction_max": 0.98})
    assert "micro_batch_size_per_device_for_experience=8" in device and "offload.params=false" not in device
    calm = advice([], {"memory/node_ram_fraction_max": 0.5, "memory/gpu_fraction_max": 0.0})
    assert calm.startswith("the planner has no change that lowers this config's own peak")


def test_the_relief_halves_a_padding_free_budget_that_the_next_update_packs_to() -> None:
    """Padding-free RL: the relief halves the run's token budget (Forward, which the driver plans the update's
    micro batches from), never the read-only config, and prices the change on the planner."""
    import torch

    from easytrain.distributed.batch import Batch
    from easytrain.trainer.micro_batches import Forward, update_shares
    from easytrain.trainer.relief import MemoryGuard

    config = load(["worker.actor.padding_free=true", "worker.actor.max_token_len_per_device=2048",
                   "data.max_prompt_length=256", "data.max_response_length=64"])
    guard = MemoryGuard.__new__(MemoryGuard)  # the relief needs the config and the run's layout: no samplers
    guard.config, guard.roles, guard.forward = config, object(), Forward.of(config, {})
    rows = Batch({"attention_mask": torch.ones(32, 100, dtype=torch.long)})  # 32 samples of 100 tokens

    def largest_micro() -> int:
        steps, _ = update_shares(rows, len(rows), 1, guard.forward)
        return max(len(micro) for micro in steps[0][0])

    assert largest_micro() == 20  # 2048 // 100 samples
    relief = guard.halve_micro_batch({"ram"})
    assert relief.applied and relief.planned > 0 and "2048 -> 1024" in relief.detail
    assert guard.forward.budget == 1024 and config.worker.actor.max_token_len_per_device == 2048
    assert largest_micro() == 10
    guard.halve_micro_batch({"ram"})  # 512 >= 256 + 64: still allowed
    assert guard.forward.budget == 512
    stuck = guard.halve_micro_batch({"ram"})  # 256 < one sample's 320 tokens
    assert not stuck.applied and "cannot halve" in stuck.detail and guard.forward.budget == 512


# ----------------------------------------------------------------------------- samplers on a real Ray


class BrokenNVML(RecordedNVML):
    def nvmlDeviceGetMemoryInfo(self, handle: int) -> MemoryInfo:
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")


def test_a_sampler_reads_node_processes_and_gpus_and_survives_a_lost_gpu(ray_local: None) -> None:
    import os

    import ray

    from easytrain.memory.watchdog import NodeSampler

    sampler = NodeSampler(ray.get_runtime_context().get_node_id(), period_s=60.0, limit_bytes=None)
    try:
        sampler.register([(os.getpid(), "driver", 0), (2**22 + 12345, "actor", 0)])  # the second pid: gone
        sampler.nvml = RecordedNVML([10 * GB, 20 * GB])
        kinds = [r["kind"] for r in sampler.sample()]
        assert kinds == ["node", "process", "gpu", "gpu"]  # a process that is gone is left out
        sampler.nvml = BrokenNVML([10 * GB])
        assert [r["kind"] for r in sampler.sample()] == ["node", "process"]
        assert sampler.nvml is None  # GPU sampling stops; RAM goes on
        drained = sampler.drain(sample_now=False)
        assert [r["kind"] for r in drained] == ["node", "process", "gpu", "gpu", "node", "process"]
        assert sampler.drain(sample_now=False) == []
    finally:
        sampler.stop()


def test_run_scope_judges_the_runs_own_processes_against_the_share(ray_local: None) -> None:
    import os
    import subprocess
    import sys

    import ray

    from easytrain.memory.watchdog import NodeSampler

    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(256 * 2**20); time.sleep(60)"])
    sampler = NodeSampler(ray.get_runtime_context().get_node_id(), period_s=60.0, limit_bytes=8 * GB, scope="run")
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).memory_info().rss < 256 * MB and time.monotonic() < deadline:
            time.sleep(0.1)
        sampler.register([(os.getpid(), "driver", 0), (child.pid, "reward", 0)])
        node, *processes = sampler.sample()
        rss = {r["pid"]: r["rss_bytes"] for r in processes}
        assert set(rss) == {os.getpid(), child.pid} and rss[child.pid] >= 256 * MB
        assert node["scope"] == "run" and node["ram_used_bytes"] == sum(rss.values())
        assert node["ram_fraction"] == pytest.approx(sum(rss.values()) / (8 * GB))
        vm = psutil.virtual_memory()
        assert abs(node["node_used_bytes"] - (vm.total - vm.available)) < 512 * MB  # the node's use, kept beside
    finally:
        sampler.stop()
        child.kill()
        child.wait()


def test_the_watchdog_collects_per_step_and_replaces_a_dead_sampler(ray_local: None, tmp_path: Path) -> None:
    import json
    import os

    import ray

    from easytrain.memory.readings import process_info
    from easytrain.memory.watchdog import Watchdog

    config = load([f"trainer.output_dir={tmp_path}", "watchdog.sample_period_s=0.05"])
    dog = Watchdog(config, str(tmp_path))
    try:
        dog.register([process_info("driver", 0)])
        import time

        time.sleep(0.5)  # the sampler's own thread reads every 0.05 s meanwhile
        first = dog.collect(1)
        assert first.level in ("ok", "warn") and "memory/node_ram_fraction_max" in first.metrics
        assert dog.latest[("driver", 0)][1] > 50 * MB
        (node,) = dog.samplers
        ray.kill(dog.samplers[node])
        dog.collect(2)  # the dead sampler is dropped, and its node (alive) gets a new one
        assert list(dog.samplers) == [node]
        dog.collect(3)
    finally:
        dog.close(plot=False)
    records = [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]
    pids = {r["pid"] for r in records if r["kind"] == "process"}
    assert pids == {os.getpid()}
    assert [r["nodes"] for r in records if r["kind"] == "samplers"][-1] == [node]
    node_samples = [r for r in records if r["kind"] == "node"]
    assert len(node_samples) >= 5 and all(r["node_id"] == node for r in node_samples)


def test_samples_reach_the_dashboard_as_ray_metrics(ray_local: None) -> None:
    """The sampler's gauges appear on the node's Prometheus endpoint (what the Ray dashboard charts)."""
    import os
    import time
    import urllib.request

    import ray

    from easytrain.memory.watchdog import NodeSampler

    node = next(n for n in ray.nodes() if n["Alive"])
    sampler = ray.remote(NodeSampler).options(num_cpus=0).remote(node["NodeID"], 0.2, None)
    try:
        ray.get(sampler.register.remote([(os.getpid(), "driver", 0)]))
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        deadline, found = time.monotonic() + 60, []
        while time.monotonic() < deadline and len(found) < 2:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            found = [line for line in text.splitlines() if line.startswith(("ray_easytrain_node_ram_used_bytes{",
                                                                            "ray_easytrain_worker_rss_bytes{"))]
            time.sleep(1)
        assert any(line.startswith("ray_easytrain_node_ram_used_bytes{") and float(line.split()[-1]) > 1e8
                   for line in found), found
        assert any('role="driver"' in line for line in found), found
    finally:
        ray.get(sampler.stop.remote())
        ray.kill(sampler)
