"""The config sections of where a run executes and how it is kept alive: the memory watchdog
(``watchdog.*``), Ray (``ray.*``) and the cluster launch (``launch.*``). Part of the schema
(:mod:`easytrain.config.schema` composes them into :class:`~easytrain.config.schema.Config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from easytrain.config.fields import Section, bounded, choice

# ----------------------------------------------------------------------------- memory watchdog


@dataclass
class WatchdogConfig(Section):
    enabled: bool = True
    """Sample memory on every node (one sampler actor per node), write memory.jsonl and act on pressure."""
    sample_period_s: float = bounded(1.0, low=0.0, low_open=True)
    """Seconds between samples."""
    ram_warn: float = bounded(0.80, low=0.0, high=1.0, low_open=True)
    """Node RAM fraction that is logged as a warning (and shown on the dashboard)."""
    ram_soft: float = bounded(0.85, low=0.0, high=1.0, low_open=True)
    """Node RAM fraction that triggers relief at the next step boundary (watchdog.actions)."""
    ram_hard: float = bounded(0.92, low=0.0, high=1.0, low_open=True)
    """Node RAM fraction that triggers a checkpoint and a clean stop; must stay below Ray's kill line
    (RAY_memory_usage_threshold, 0.95 by default), where Ray's monitor starts killing workers."""
    ram_limit_gb: Optional[float] = bounded(None, low=0.0, low_open=True)
    """RAM the fractions are taken of, per node; null = the node's memory, or its container's (cgroup) limit
    when lower. Set it to keep a run within part of a shared node."""
    ram_scope: str = choice("node", "node", "run")
    """What the RAM fractions measure: node = the node's whole use (host total minus available, or the
    container's working set: what Ray's memory monitor and Kubernetes judge); run = the summed RSS of this run's
    own processes on the node (driver, workers, reward workers), for a share of a node other jobs also use
    (needs watchdog.ram_limit_gb: the share)."""
    vram_warn: float = bounded(0.85, low=0.0, high=1.0, low_open=True)
    """GPU memory fraction (NVML, used / total) that is logged as a warning."""
    vram_soft: float = bounded(0.90, low=0.0, high=1.0, low_open=True)
    """GPU memory fraction that triggers relief."""
    vram_hard: float = bounded(0.97, low=0.0, high=1.0, low_open=True)
    """GPU memory fraction that triggers a checkpoint and a clean stop."""
    actions: list[str] = field(default_factory=lambda: ["free_caches", "sleep_rollout", "offload_ref"])
    """Relief at the soft level, in order: free_caches (allocator caches and freed heap back to the OS),
    sleep_rollout (GPU pressure: vLLM sleep level 1 until the next rollout), offload_ref (GPU pressure: names
    worker.ref.offload.params for the next launch, since FSDP2 fixes offload when it shards), halve_micro_batch
    (the update's micro batch from the next update on; changes rounding, not what is trained)."""
    imbalance_factor: float = bounded(1.5, low=1.0)
    """Report a rank whose memory exceeds the median of its role by this factor."""
    leak_warmup_steps: int = bounded(5, low=0)
    """Steps ignored by leak detection (caches and allocators fill up first)."""
    leak_mb_per_step: float = bounded(20.0, low=0.0, low_open=True)
    """Report steady growth of host RAM or GPU reserved memory above this many MB per step."""
    plot: bool = True
    """Draw memory.png (RAM/VRAM per node and role over time) at the end of the run."""


# ----------------------------------------------------------------------------- ray


@dataclass
class RayConfig(Section):
    address: Optional[str] = None
    """Cluster to join; null = RAY_ADDRESS if set, else the cluster `ray start` left on this machine, else a new
    local Ray; `local` = always a new local Ray."""
    num_cpus: Optional[int] = bounded(None, low=1)
    """CPUs of a local Ray started by easytrain; null = all of this machine's."""
    include_dashboard: bool = True
    """Start the dashboard with a local Ray."""
    wait_for_nodes_s: int = bounded(0, low=0)
    """A joined cluster without trainer.nnodes nodes that hold trainer.workers_per_node workers: seconds to wait for
    an autoscaler to add them before the run fails; 0 = fail at once, naming what is missing."""


# ----------------------------------------------------------------------------- launch


@dataclass
class LaunchConfig(Section):
    """How the run is launched on a cluster: Ray Jobs (``easytrain submit``) and KubeRay (``--kuberay``)."""

    image: str = "easytrain:latest"
    """KubeRay: container image of every Ray pod (docker/Dockerfile, pushed where the cluster pulls from)."""
    image_pull_policy: str = choice("IfNotPresent", "IfNotPresent", "Always", "Never")
    """KubeRay: when the kubelet pulls the image."""
    ray_version: str = "2.60.0"
    """KubeRay: Ray version inside the image (RayCluster spec.rayVersion); docker/Dockerfile's base has the same."""
    namespace: str = "default"
    """KubeRay: Kubernetes namespace of the RayJob / RayCluster."""
    name: Optional[str] = None
    """KubeRay: name of the RayJob / RayCluster (lowercase letters, digits and '-', at most 47 characters);
    null = trainer.experiment_name made into such a name. Runs go to <volume_mount_path>/runs/<name>."""
    service_account: Optional[str] = None
    """KubeRay: service account of the Ray pods; null = the namespace's default."""
    volume_claim: str = "easytrain-shared"
    """KubeRay: PersistentVolumeClaim mounted on every pod (ReadWriteMany when trainer.nnodes > 1): run folders
    with checkpoints, and the Hugging Face cache (models, data sets)."""
    volume_mount_path: str = "/mnt/easytrain"
    """KubeRay: where the claim is mounted; the run folder (hydra.run.dir) is <path>/runs/<name> unless
    trainer.output_dir is already on it, HF_HOME is <path>/cache/huggingface."""
    secret_env: dict[str, str] = field(default_factory=lambda: {"HF_TOKEN": "hf-token/token",
                                                                "WANDB_API_KEY": "wandb/api-key"})
    """KubeRay: environment variables read from Kubernetes Secrets, NAME: secret/key (secretKeyRef). A Secret the
    run needs is required (a missing one keeps the pods from starting, named by Kubernetes): HF_TOKEN when the
    model comes from the Hub and is not one of conf/model/'s public checkpoints, WANDB_API_KEY when wandb logs
    online, every entry you add; the others are optional. Tokens never appear in the manifests."""
    auth_secret: Optional[str] = None
    """KubeRay: Secret holding Ray's token under the key auth_token; null = KubeRay generates one per cluster.
    Token authentication is always on (authOptions.mode=token)."""
    env_vars: dict[str, str] = field(default_factory=dict)
    """Plain environment variables of the run (Ray Jobs runtime env; every KubeRay pod); no secrets here."""
    pip: list[str] = field(default_factory=list)
    """Extra pip requirements Ray installs for the job (runtime env of Ray Jobs and of the RayJob)."""
    stop_grace_s: int = bounded(900, low=10)
    """Seconds a stopped run has to save its current step before it is killed: the job's
    ``RAY_JOB_STOP_WAIT_TIME_S`` (``easytrain stop``; Ray's default is 3 s) and, on KubeRay, the pods'
    ``terminationGracePeriodSeconds`` (the head's preStop hook stops the job and waits). Cover a step plus a save."""
    ttl_seconds_after_finished: int = bounded(3600, low=0)
    """KubeRay RayJob: seconds the finished job's cluster stays (for logs) before it is deleted."""
    backoff_limit: int = bounded(1, low=0)
    """KubeRay RayJob: retries, each on a new cluster; a retry resumes from the latest checkpoint of the run
    folder on the shared volume (trainer.resume=auto)."""
    head_cpu: float = bounded(8.0, low=0.0, low_open=True)
    """KubeRay: CPUs of the head pod (driver, data loader processes, reward actors; no GPUs)."""
    head_memory_gb: float = bounded(64.0, low=0.0, low_open=True)
    """KubeRay: memory of the head pod, GB."""
    worker_cpu: Optional[float] = bounded(None, low=0.0, low_open=True)
    """KubeRay: CPUs of a worker pod (one per node); null = 8 per worker process (trainer.workers_per_node)."""
    worker_memory_gb: Optional[float] = bounded(None, low=0.0, low_open=True)
    """KubeRay: memory of a worker pod, GB; null = 90% of trainer.node_memory_gb (the rest for the kubelet and
    system daemons). The watchdog's and Ray's fractions are then of this limit (the pod's cgroup)."""
    object_store_gb: Optional[float] = bounded(None, low=0.0, low_open=True)
    """KubeRay: Ray object store per worker pod, GB; null = Ray's default, 30% of the pod's memory, at most 200."""
    shm_headroom_gb: float = bounded(8.0, low=0.0)
    """KubeRay: /dev/shm (a memory-backed emptyDir) holds the object store plus this much, at most 10% of the
    pod's memory (NCCL, vLLM, data loader buffers); a /dev/shm smaller than the object store makes Ray fall
    back to disk."""
