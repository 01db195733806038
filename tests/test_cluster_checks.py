"""Issue 23 item 6: a GPU run asks for devices the cluster can hold, said in one line before anything waits."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from easytrain.config import load, with_overrides
from easytrain.config import ConfigError
from easytrain.config.schema import RayConfig
from easytrain.distributed.cluster import check_cluster_fits, check_local_gpus, places, ray_address


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


def test_pool_places_on_distinct_nodes() -> None:
    # a pool takes workers_per_node devices of a node, and never two places on one node
    assert places([8, 8, 8, 8], workers_per_node=8, pools=2) == 4  # actor on two nodes, rollout on the other two
    assert places([16, 16], workers_per_node=8, pools=2) == 4  # both pools on both nodes
    assert places([16], workers_per_node=8, pools=2) == 2  # one node: room for one pool-node pair of 2 nodes
    assert places([24, 8], workers_per_node=8, pools=2) == 3  # the big node holds each pool once, not three times
    assert places([7, 7], workers_per_node=8, pools=1) == 0


def test_a_cluster_that_cannot_hold_the_pools_is_a_config_error_naming_both_numbers(ray_local: None) -> None:
    import ray

    cpus = [n["Resources"]["CPU"] for n in ray.nodes() if n["Alive"]]
    assert cpus == [8]  # the tests' local Ray: one node, 8 logical CPUs
    config = load([])  # (sizes set past validation below: only the pools' shape matters here)
    check_cluster_fits(with_overrides(config, {"trainer.workers_per_node": 8}))  # one colocated pool of 8
    with pytest.raises(ConfigError, match=r"^trainer.workers_per_node=9: the run needs 9 CPU\(s\) on each of "
                                          r"trainer.nnodes=1 node\(s\), and the local Ray easytrain started has 1 "
                                          r"node\(s\) with 8 CPU\(s\): room for 0 of the 1 pool-node places"):
        check_cluster_fits(with_overrides(config, {"trainer.workers_per_node": 9}))
    pools = {"trainer.colocate": False, "algorithm.kl_coef": 0.0}
    check_cluster_fits(with_overrides(config, {**pools, "trainer.workers_per_node": 4}))  # actor and rollout: 4 each
    with pytest.raises(ConfigError, match=r"each of the run's 2 worker pools needs 5 CPU.*room for 1 of the 2 "
                                          r"pool-node places; lower trainer.workers_per_node, set trainer.colocate"):
        check_cluster_fits(with_overrides(config, {**pools, "trainer.workers_per_node": 5}))


def test_a_joined_cluster_waits_for_an_autoscaler_only_as_long_as_asked(ray_local: None) -> None:
    config = with_overrides(load(["ray.wait_for_nodes_s=2"]),  # (Ray is already up: only "joined" matters)
                            {"ray.address": "auto", "trainer.nnodes": 2})
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"room for 1 of the 2 .*give an autoscaler ray.wait_for_nodes_s"):
        check_cluster_fits(config, poll_s=0.2)
    assert 2.0 <= time.monotonic() - start < 30  # it polled until the deadline, then gave up


def test_a_local_run_that_asks_for_more_cpus_than_ray_has_fails_in_seconds(tmp_path) -> None:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "easytrain.main", "ray.num_cpus=2", "trainer.workers_per_node=4",
                           "worker.actor.micro_batch_size_per_device_for_update=16", "ray.include_dashboard=false", f"trainer.output_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines[-1].startswith("easytrain: config error: trainer.workers_per_node=4: the run needs 4 CPU(s)"), lines
    assert "with 2 CPU(s)" in lines[-1] and "raise ray.num_cpus" in lines[-1]
    assert time.monotonic() - start < 90  # Ray's start, not the pools' 120 s wait


def test_local_starts_a_ray_of_its_own_and_an_address_is_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """``local`` (Ray's own word) in ``ray.address`` or ``RAY_ADDRESS``: easytrain starts a new Ray, never joins one."""
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert ray_address(RayConfig()) == (None, "RAY_ADDRESS")
    assert ray_address(RayConfig(address="10.0.0.1:6379")) == ("10.0.0.1:6379", "ray.address")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert ray_address(RayConfig()) == ("10.0.0.2:6379", "RAY_ADDRESS")
    assert ray_address(RayConfig(address="local")) == (None, "ray.address")
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_address(RayConfig()) == (None, "RAY_ADDRESS")
