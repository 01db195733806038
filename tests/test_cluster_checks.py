"""Issue 23 item 6: a GPU run asks for devices the cluster can hold, said in one line before anything waits."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import torch

from easytrain.config import load
from easytrain.config.validate import ConfigError
from easytrain.distributed.cluster import check_local_gpus, warn_small_nodes


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine's GPUs could hold the run")
def test_a_cuda_run_on_a_local_ray_without_the_gpus_is_a_config_error_in_seconds() -> None:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "easytrain.main", "trainer.device=cuda", "trainer.workers_per_node=2",
                           "ray.include_dashboard=false"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("easytrain: config error: trainer.workers_per_node=2: needs 2 CUDA GPU(s) per node"), lines
    assert "this machine's 0" in lines[-1] and "trainer.device=cpu" in lines[-1]
    assert time.monotonic() - start < 60  # no Ray started, no pool waiting for devices


def test_the_local_gpu_check_leaves_cpu_runs_and_joined_clusters_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    check_local_gpus(load([]))  # CPU
    check_local_gpus(load(["trainer.device=cuda", "ray.address=10.0.0.1:6379"]))  # a cluster: its nodes decide
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # (the count a driver on an 8-GPU machine reads)
    check_local_gpus(load(["trainer.device=cuda", "trainer.workers_per_node=8"]))
    with pytest.raises(ConfigError, match=r"trainer.workers_per_node=2: .*x trainer.nnodes=2.*machine's 8"):
        check_local_gpus(load(["trainer.device=cuda", "trainer.workers_per_node=2", "trainer.nnodes=2"]))


def test_a_cluster_without_a_node_that_fits_is_named(ray_local: None, caplog: pytest.LogCaptureFixture) -> None:
    import ray

    most = max(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"])
    config = load([])
    with caplog.at_level(logging.WARNING, logger="easytrain.distributed.cluster"):
        config.trainer.workers_per_node = int(most)  # (set past validation: only the node shape matters here)
        warn_small_nodes(config)
        assert not caplog.records  # this node fits
        config.trainer.workers_per_node = int(most) + 1
        warn_small_nodes(config)
    assert len(caplog.records) == 1
    assert f"needs {int(most) + 1} CPU(s) on each of 1 node(s); 0 of the cluster's" in caplog.text
    assert f"the largest has {most:g}" in caplog.text
