"""Shared test harness.

- ``ray_local``: one local Ray for the whole session (8 logical CPUs on this 2-core machine).
- ``ray_two_nodes``: a 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, 2 CPUs each);
  tests using it run last, because only one Ray can be connected at a time.
- ``eight_gpus`` and ``two_gpu_nodes``: Ray's logical GPUs for the placement tests (one node of 8, two of 4).
  Every test that needs a Ray other than the shared local one runs after all the others, grouped by the
  Ray it needs (``CLUSTER_ORDER``), so each of those Rays, and the shared local one, starts once.
- ``tiny_model``: ``tiny_model(family, size)`` builds a tiny model once per session.
- ``default_run``: the README's first command, the default run as it ships (``DEFAULT_RUN_STEPS`` steps),
  once per session (its own Ray, in a subprocess); the learning, watchdog, logger and report tests read its
  run folder.
- ``tiny_families(feature, images)``: the tiny families whose adapters serve a feature, for parametrising
  per-family tests (a family added with a tiny model is tested without editing them).
- ``writable(section)``: a changeable copy of a loaded (read-only) config section, for a test that moves a
  setting of a live object (a run's own config never changes).
- markers: ``slow`` (end-to-end; ``pytest -m 'not slow'`` skips them), ``gpu``
  (skipped without CUDA).
- Every easytrain run a test starts makes a Ray of its own (``RAY_ADDRESS=local``): it never joins a Ray
  another test (or a developer's ``ray start``) left on the machine.
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
os.environ["RAY_ADDRESS"] = "local"  # a run a test starts never joins another test's Ray (ray.address)
os.environ["EASYTRAIN_DEBUG_METHODS"] = "1"  # the workers' test-only remote methods (easytrain.workers.debug)

def tiny_families(feature: Optional[str] = None, images: bool = False) -> list[str]:
    """``tiny:<name>`` families (:data:`easytrain.models.families.TINY_FAMILIES`) whose adapter serves
    ``feature`` (one of ``FEATURES``; None: all), the image-text ones only with ``images``."""
    from easytrain.models.families import TINY_FAMILIES, adapter_class

    return [f for f in TINY_FAMILIES if (feature is None or feature in adapter_class(f).features)
            and (not images or adapter_class(f).processor_class_path)]


TWO_NODE_FIXTURE = "ray_two_nodes"
CLUSTER_ORDER = ("eight_gpus", "two_gpu_nodes", "ray_head", TWO_NODE_FIXTURE)
"""Fixtures of a Ray other than the shared local one, in the order their tests run, after every other test
(``ray_head``: tests/test_submit.py, whose ``ray stop --force`` ends every Ray on the machine)."""


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

    def eight_gpus(self) -> None:
        """One local node with 8 logical GPUs (and 32 logical CPUs). ``address="local"``: a new Ray even while
        another session's cluster runs on this machine."""
        import ray

        if self.kind == "eight_gpus" and ray.is_initialized():
            return
        self.stop()
        ray.init(address="local", num_cpus=32, num_gpus=8, include_dashboard=False, namespace="easytrain-tests",
                 log_to_driver=False)
        self.kind = "eight_gpus"

    def two_nodes(self):  # -> ray.cluster_utils.Cluster
        return self._nodes("two_nodes", {"num_cpus": 2})

    def two_gpu_nodes(self):  # -> ray.cluster_utils.Cluster
        return self._nodes("two_gpu_nodes", {"num_cpus": 12, "num_gpus": 4})

    def _nodes(self, kind: str, resources: dict[str, int]):  # -> ray.cluster_utils.Cluster
        """A cluster of two nodes with ``resources`` each on this machine."""
        import ray
        from ray.cluster_utils import Cluster

        if self.kind == kind and ray.is_initialized():
            return self.cluster
        self.stop()
        cluster = Cluster(initialize_head=True, head_node_args={**resources, "include_dashboard": False})
        cluster.add_node(**resources)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="easytrain-tests", log_to_driver=False)
        self.cluster, self.kind = cluster, kind
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


def writable(section: Any) -> Any:
    """A deep copy of a read-only config section that a test may assign to."""
    import copy

    from easytrain.config.fields import freeze

    out = copy.deepcopy(section)
    freeze(out, False)
    return out


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


@pytest.fixture
def eight_gpus(ray_clusters: RayClusters) -> None:
    """One local node with 8 logical GPUs (replaces the shared local Ray; a later ``ray_local`` restarts it)."""
    ray_clusters.eight_gpus()


@pytest.fixture
def two_gpu_nodes(ray_clusters: RayClusters):
    """Two nodes of 4 logical GPUs (and 12 logical CPUs) each."""
    return ray_clusters.two_gpu_nodes()


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
    # Another Ray replaces the shared local one: those tests run last, grouped by the Ray they need (a stable
    # sort: file order otherwise).
    items.sort(key=cluster_rank)


def cluster_rank(item: pytest.Item) -> int:
    names = getattr(item, "fixturenames", ())
    return next((i + 1 for i, name in enumerate(CLUSTER_ORDER) if name in names), 0)


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
    return run_main(tmp_path_factory.mktemp("default") / "run")


def run_main(run_dir: Path, *overrides: str) -> Path:
    """``python -m easytrain.main`` with ``overrides`` (no dashboard) in a process of its own; its run folder."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "easytrain.main", "ray.include_dashboard=false",
                           f"hydra.run.dir={run_dir}", *overrides], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir
