"""Shared test harness.

- ``ray_local``: one local Ray for the whole session (8 logical CPUs on this 2-core machine).
- ``ray_two_nodes``: a 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, 2 CPUs each);
  tests using it run last, because only one Ray can be connected at a time.
- ``tiny_model``: ``tiny_model(family, size)`` builds a tiny model once per session.
- ``default_run``: the README's first command, the default run as it ships (``DEFAULT_RUN_STEPS`` steps),
  once per session (its own Ray, in a subprocess); the learning, watchdog, logger and report tests read its
  run folder.
- markers: ``slow`` (end-to-end; ``pytest -m 'not slow'`` skips them), ``gpu``
  (skipped without CUDA).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

TWO_NODE_FIXTURE = "ray_two_nodes"


class RayClusters:
    """Owns whichever Ray the tests are connected to, so fixtures can switch safely."""

    def __init__(self) -> None:
        self.kind: Optional[str] = None
        self.cluster = None

    def local(self) -> None:
        import ray

        if self.kind == "local" and ray.is_initialized():
            return
        self.stop()
        # 8 logical CPUs on 2 cores: tests place several small worker groups side by side.
        ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="easytrain-tests", log_to_driver=False)
        self.kind = "local"

    def two_nodes(self):  # -> ray.cluster_utils.Cluster
        import ray
        from ray.cluster_utils import Cluster

        if self.kind == "two_nodes" and ray.is_initialized():
            return self.cluster
        self.stop()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="easytrain-tests", log_to_driver=False)
        self.cluster, self.kind = cluster, "two_nodes"
        return cluster

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        self.kind = None


_clusters = RayClusters()


@pytest.fixture(scope="session")
def ray_clusters() -> Iterator[RayClusters]:
    yield _clusters
    _clusters.stop()


@pytest.fixture
def ray_local(ray_clusters: RayClusters) -> None:
    """A local Ray shared by every test that asks for it (started once per session)."""
    ray_clusters.local()


@pytest.fixture
def ray_two_nodes(ray_clusters: RayClusters):
    """A 2-node Ray cluster on this machine (1 CPU per node)."""
    return ray_clusters.two_nodes()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_model(family, size="tiny", seed=0)`` -> folder, built once per session."""
    from easytrain.models.tiny import build_tiny

    cache = tmp_path_factory.mktemp("easytrain-cache")

    def get(family: str, size: str = "tiny", seed: int = 0) -> Path:
        return build_tiny(family, size, seed, cache)

    return get


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
    # The 2-node cluster replaces the shared local Ray: run those tests last.
    items.sort(key=lambda item: TWO_NODE_FIXTURE in getattr(item, "fixturenames", ()))


@pytest.fixture
def recorded_attention() -> Iterator[list[dict[str, Any]]]:
    """Every language-model attention call through transformers' attention interface (the real sdpa runs)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    calls: list[dict[str, Any]] = []

    def recording(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, **kwargs: Any) -> Any:
        if "Vision" not in type(module).__name__:
            calls.append({"query": tuple(query.shape), "mask": None if attention_mask is None else
                          attention_mask.detach().clone()})
        return original(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("sdpa", recording)
    try:
        yield calls
    finally:
        AttentionInterface.register("sdpa", original)


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The kill/resume and memory-pressure tests' reference: the harness run (resume_harness.RUN_ARGS) with the
    pressure harness's watchdog settings, uninterrupted, and the peak RAM of its own processes. One run serves
    both: the ballast reward scores like the spread reward while it holds no ballast, and the watchdog's
    sampling period does not touch the numerics."""
    from pressure_harness import WATCH, records, run_peak
    from resume_harness import STEPS, Run, logged_steps

    run_dir = tmp_path_factory.mktemp("reference") / "uninterrupted"
    run = Run(run_dir, *WATCH).start()
    assert run.wait() == 0, run.tail()
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    peak = run_peak(run_dir)
    assert not [e for e in records(run_dir, "event") if e["level"] in ("soft", "hard")]
    return run_dir, peak


DEFAULT_RUN_STEPS = 192
"""conf/exp/tiny.yaml: 512 synthetic prompts / 16 per step x 6 epochs."""


@pytest.fixture(scope="session")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m easytrain.main`` as it ships (watchdog, loggers, validation, report; no dashboard), all of its
    ``DEFAULT_RUN_STEPS`` steps; its run folder."""
    import subprocess
    import sys

    run_dir = tmp_path_factory.mktemp("default") / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "easytrain.main", "ray.include_dashboard=false",
                           f"hydra.run.dir={run_dir}"], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir
