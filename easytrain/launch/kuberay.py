"""KubeRay: a RayJob (one run, its cluster torn down after) and a RayCluster (long-lived) from the config.

    easytrain submit --kuberay --dry-run +exp=qwen25vl_7b trainer.nnodes=2    # the RayJob as YAML, nothing else
    easytrain submit --kuberay +exp=qwen25vl_7b                               # created with the kubernetes client
    python -m easytrain.launch.kuberay --out launcher/kuberay +exp=qwen25vl_7b  # rayjob.yaml + raycluster.yaml

Both manifests (``ray.io/v1``) come from the composed, validated config:

- a head group with no GPUs (``num-gpus: "0"``) that runs the driver, ``launch.head_cpu`` / ``head_memory_gb``;
- one worker group of ``trainer.nnodes`` pods (min = max = replicas, no autoscaling), each with
  ``trainer.workers_per_node`` GPUs (``nvidia.com/gpu``) on cuda, ``launch.worker_cpu`` CPUs and
  ``launch.worker_memory_gb`` (default 90% of ``trainer.node_memory_gb``) as requests = limits;
- ``/dev/shm`` a memory-backed emptyDir sized for Ray's object store (``object-store-memory``, same number)
  plus ``launch.shm_headroom_gb``: Ray puts its object store there only when it fits;
- Ray's memory monitor: ``RAY_memory_usage_threshold`` is the kill line the watchdog's config was checked
  against (:func:`easytrain.config.derived.ray_kill_threshold`: this environment's value, else Ray's 0.95),
  so ``watchdog.ram_hard`` is below it in the pods too; ``RAY_memory_monitor_refresh_ms`` pinned to Ray's 250
  (0 would turn the monitor off and leave OOMs to the kernel);
- Ray's token authentication on through the CRD's ``authOptions`` (``mode: token``; the token in the Secret
  ``launch.auth_secret`` under ``auth_token``, or one KubeRay generates per cluster);
- the PersistentVolumeClaim ``launch.volume_claim`` at ``launch.volume_mount_path`` on every pod: the run
  folder (``hydra.run.dir=<mount>/runs/<name>`` unless ``trainer.output_dir`` is already on it, so a retry of
  the RayJob resumes from its checkpoints) and the Hugging Face cache (``HF_HOME``);
- credentials only as ``valueFrom.secretKeyRef`` (``launch.secret_env``), never as values; a Secret the run
  needs is required (a pod whose Secret is missing does not start, and ``kubectl describe pod`` names it,
  rather than a 401 once the cluster is up), see :func:`secret_required`;
- every container non-root (the image's uid 1000, gid 100), without privilege escalation, with no Linux
  capabilities and the runtime's default seccomp profile (:data:`SECURITY_CONTEXT`);
- the RayJob: entrypoint ``python -m easytrain.main <overrides>``, ``shutdownAfterJobFinishes``,
  ``ttlSecondsAfterFinished``, ``backoffLimit``, ``launch.pip`` as its runtime env.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

from easytrain.config import Config, ConfigError, with_default_preset
from easytrain.config.derived import ray_kill_threshold
from easytrain.config.k8s_names import RAYJOB_NAME_MAX
from easytrain.config.paths import BUILT_PREFIXES, looks_local
from easytrain.config.presets import known_hf_configs

logger = logging.getLogger(__name__)

API_VERSION = "ray.io/v1"
PLURALS = {"RayJob": "rayjobs", "RayCluster": "rayclusters"}
GPU_RESOURCE = "nvidia.com/gpu"
CPU_PER_WORKER = 8
"""Default CPUs of a worker pod per worker process (launch.worker_cpu=null)."""
NODE_SHARE = 0.9
"""Default memory of a worker pod as a share of trainer.node_memory_gb (the rest: kubelet, system daemons)."""
OBJECT_STORE_SHARE, OBJECT_STORE_CAP_GB = 0.3, 200.0
"""Ray's defaults (DEFAULT_OBJECT_STORE_MEMORY_PROPORTION, DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES)."""
SHM_HEADROOM_SHARE = 0.1
"""launch.shm_headroom_gb is capped at this share of a pod's memory (small pods)."""
SHM_MAX_SHARE = 0.5
"""/dev/shm is memory-backed and counted in the pod's memory: at most this share of it."""
RAY_MEMORY_MONITOR_REFRESH_MS = 250
"""Ray's default period of its memory monitor; pinned so the monitor is on (0 turns it off)."""
RUN_KEYS = ("hydra.run.dir", "trainer.output_dir")
HEAD_PORTS = [("gcs-server", 6379), ("dashboard", 8265), ("client", 10001), ("metrics", 8080)]
SHM_VOLUME, SHARED_VOLUME = "shm", "shared"
RAY_UID, RAY_GID = 1000, 100
"""The user of Ray's images (rayproject/ray: ``ray``, uid 1000, group users 100), which docker/Dockerfile keeps."""
SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True, "runAsUser": RAY_UID, "runAsGroup": RAY_GID,
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""Every Ray container's: Ray, the trainer and the preStop hook need no root, capability or setuid binary (GPUs
come through the device plugin, /dev/shm is an emptyDir)."""


class KubeError(RuntimeError):
    """The manifests could not be applied (no kubeconfig, no client, refused by the API server)."""


# ----------------------------------------------------------------------------- render


def k8s_name(text: str) -> str:
    """``text`` as a RayJob name: lowercase letters, digits and '-', starting with a letter, <= 47 chars."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if not name[:1].isalpha():
        name = f"easytrain-{name}".rstrip("-")
    return name[:RAYJOB_NAME_MAX].rstrip("-")


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def run_folder(config: Config, overrides: Sequence[str], name: str) -> tuple[str, list[str]]:
    """The run folder on the shared volume, and the overrides that put the run there."""
    mount = os.path.normpath(config.launch.volume_mount_path)
    out = config.trainer.output_dir
    if os.path.isabs(out):
        if os.path.commonpath([mount, os.path.normpath(out)]) != mount:
            raise ConfigError("trainer.output_dir", out, f"is not on the shared volume (launch.volume_mount_path="
                              f"{mount}): checkpoints would be lost with the pod and a retry could not resume",
                              f"use a folder under {mount}, or leave it unset for {mount}/runs/{name}")
        return out, []
    if any(_key(o) in RUN_KEYS for o in overrides):
        raise ConfigError("trainer.output_dir", out, "a relative run folder would land in the Ray job's working "
                          "directory inside the pod, not on the shared volume", f"use an absolute folder under {mount}")
    folder = f"{mount}/runs/{name}"
    return folder, [f"hydra.run.dir={folder}"]


def entrypoint(overrides: Sequence[str], extra: Sequence[str] = ()) -> str:
    """``python -m easytrain.main`` with the overrides (preset first; ``launch.*`` only shapes the manifests)."""
    kept = [o for o in with_default_preset(list(overrides)) if not _key(o).startswith("launch.")]
    return shlex.join(["python", "-m", "easytrain.main", *kept, *extra])


def _gb(value: float) -> str:
    """A Kubernetes quantity in decimal gigabytes (the config's GB are 10^9 bytes)."""
    return f"{int(value)}G" if float(value).is_integer() else f"{round(value * 1000)}M"


def _cpu(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def _object_store(memory_gb: float, override: Optional[float], headroom: float) -> tuple[float, float]:
    """(object store GB, /dev/shm GB) for a pod of ``memory_gb``: Ray's default store unless ``override``
    (launch.object_store_gb), plus the headroom; /dev/shm must leave the pod memory to work in."""
    store = override if override is not None else min(OBJECT_STORE_SHARE * memory_gb, OBJECT_STORE_CAP_GB)
    store, shm = round(store, 3), round(store + min(headroom, SHM_HEADROOM_SHARE * memory_gb), 3)
    if shm > SHM_MAX_SHARE * memory_gb:  # only reachable with an override: defaults take at most 40%
        raise ConfigError("launch.object_store_gb", override, f"/dev/shm ({store:g} GB object store + headroom) "
                          f"is memory a worker pod's {memory_gb:g} GB must hold; it may take at most "
                          f"{SHM_MAX_SHARE:.0%} of it", f"use at most {SHM_MAX_SHARE * memory_gb - shm + store:g}, "
                          "or give the pods more memory (launch.worker_memory_gb)")
    return store, shm


def _worker_size(config: Config) -> tuple[float, float]:
    """(CPUs, memory GB) of a worker pod."""
    la, t = config.launch, config.trainer
    memory = la.worker_memory_gb
    if memory is None:
        if t.node_memory_gb is None:
            raise ConfigError("launch.worker_memory_gb", None, "the worker pods need a memory size and "
                              "trainer.node_memory_gb is not set either",
                              "set trainer.node_memory_gb (the nodes' RAM, which `easytrain plan` also checks) or "
                              "launch.worker_memory_gb")
        memory = float(math.floor(NODE_SHARE * t.node_memory_gb))
    cpu = la.worker_cpu if la.worker_cpu is not None else float(CPU_PER_WORKER * t.workers_per_node)
    if cpu < t.workers_per_node:
        raise ConfigError("launch.worker_cpu", la.worker_cpu, f"the run's placement group takes 1 CPU per worker "
                          f"process, {t.workers_per_node} per node (trainer.workers_per_node)",
                          f"use at least {t.workers_per_node}")
    return cpu, memory


def _env(config: Config) -> list[dict[str, Any]]:
    la = config.launch
    mount = os.path.normpath(la.volume_mount_path)
    plain = {"RAY_JOB_STOP_WAIT_TIME_S": str(la.stop_grace_s), "EASYTRAIN_STOP_GRACE_S": str(la.stop_grace_s),
             "RAY_memory_usage_threshold": f"{ray_kill_threshold():g}",
             "RAY_memory_monitor_refresh_ms": str(RAY_MEMORY_MONITOR_REFRESH_MS),
             "HF_HOME": f"{mount}/cache/huggingface",
             "TOKENIZERS_PARALLELISM": "false"}
    plain.update({str(k): str(v) for k, v in la.env_vars.items()})
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in plain.items() if k not in la.secret_env]
    for name, ref in la.secret_env.items():
        secret, _, key = str(ref).partition("/")
        selector: dict[str, Any] = {"name": secret, "key": key}
        if not secret_required(name, config):
            selector["optional"] = True
        env.append({"name": name, "valueFrom": {"secretKeyRef": selector}})
    return env


def secret_required(name: str, config: Config) -> bool:
    """Whether the run needs the Secret behind ``launch.secret_env.<name>``: a missing required Secret keeps the
    pods from starting (naming it); an optional one leaves the variable unset. Optional only where the run
    provably does without it:

    - ``HF_TOKEN`` when nothing comes from the Hugging Face Hub but the public checkpoints of ``conf/model/``
      (model and tokenizer are such a checkpoint, folders or built, or ``HF_HUB_OFFLINE=1``); another Hub model
      may be gated or private (a 401 after the cluster is up). For a public one without a token, drop the
      entry: ``~launch.secret_env.HF_TOKEN``.
    - ``WANDB_API_KEY`` when ``wandb`` is not in ``trainer.loggers`` or ``WANDB_MODE`` is offline/disabled.

    Every other entry is one the user added, so the run needs it."""
    env = {str(k): str(v).lower() for k, v in config.launch.env_vars.items()}
    if name == "HF_TOKEN":
        public = set(known_hf_configs())  # the presets' checkpoints: public, downloaded without a token
        sources = [config.model.path, config.model.tokenizer_path or ""]
        # a folder or a built model is not downloaded; judged by the text alone: the pods' disks are not this one
        from_hub = any(s and not s.startswith(BUILT_PREFIXES) and not looks_local(s, on_disk=False) and s not in public
                       for s in sources)
        return from_hub and env.get("HF_HUB_OFFLINE", "0") not in ("1", "true")
    if name == "WANDB_API_KEY":
        return "wandb" in config.trainer.loggers and env.get("WANDB_MODE", "online") not in ("offline", "disabled")
    return True


def _container(name: str, config: Config, cpu: float, memory_gb: float, gpus: int,
               ports: Sequence[tuple[str, int]] = ()) -> dict[str, Any]:
    la = config.launch
    resources = {"cpu": _cpu(cpu), "memory": _gb(memory_gb)}
    if gpus:
        resources[GPU_RESOURCE] = str(gpus)
    container: dict[str, Any] = {
        "name": name, "image": la.image, "imagePullPolicy": la.image_pull_policy, "env": _env(config),
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "securityContext": copy.deepcopy(SECURITY_CONTEXT),
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"},
                         {"name": SHARED_VOLUME, "mountPath": os.path.normpath(la.volume_mount_path)}],
    }
    if ports:
        container["ports"] = [{"name": port_name, "containerPort": port} for port_name, port in ports]
    # a stop saves first: the head stops the job (its driver saves), a worker keeps its node up until it has
    hook = ["python", "-m", "easytrain.launch.prestop"] + ([] if ports else ["--wait-only"])
    container["lifecycle"] = {"preStop": {"exec": {"command": hook}}}
    return container


def _pod(container: dict[str, Any], config: Config, shm_gb: float, labels: dict[str, str],
         gpus: int) -> dict[str, Any]:
    la = config.launch
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": la.stop_grace_s + 30,  # the preStop hook gives up 5 s before stop_grace_s
        "containers": [container],
        "volumes": [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": _gb(shm_gb)}},
                    {"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": la.volume_claim}}],
    }
    if la.service_account:
        spec["serviceAccountName"] = la.service_account
    if gpus:  # GPU node pools are commonly tainted so that only GPU pods land there
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": dict(labels)}, "spec": spec}


def cluster_spec(config: Config, labels: dict[str, str]) -> dict[str, Any]:
    """The RayCluster spec both manifests share: auth, head group, one worker group of trainer.nnodes pods."""
    la, t = config.launch, config.trainer
    gpus = t.workers_per_node if t.device == "cuda" else 0
    head_store, head_shm = _object_store(la.head_memory_gb, None, la.shm_headroom_gb)
    worker_cpu, worker_memory = _worker_size(config)
    store, shm = _object_store(worker_memory, la.object_store_gb, la.shm_headroom_gb)
    head = _container("ray-head", config, la.head_cpu, la.head_memory_gb, 0, HEAD_PORTS)
    worker = _container("ray-worker", config, worker_cpu, worker_memory, gpus)
    worker_params = {"object-store-memory": str(int(store * 10**9))}
    if gpus:
        worker_params["num-gpus"] = str(gpus)
    auth: dict[str, Any] = {"mode": "token"}
    if la.auth_secret:
        auth["secretName"] = la.auth_secret
    return {
        "rayVersion": la.ray_version,
        "authOptions": auth,
        "enableInTreeAutoscaling": False,
        "headGroupSpec": {
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0",
                               "object-store-memory": str(int(head_store * 10**9))},
            "template": _pod(head, config, head_shm, labels, 0),
        },
        "workerGroupSpecs": [{
            "groupName": "gpu" if gpus else "cpu",
            "replicas": t.nnodes, "minReplicas": t.nnodes, "maxReplicas": t.nnodes,
            "rayStartParams": worker_params,
            "template": _pod(worker, config, shm, labels, gpus),
        }],
    }


def render(config: Config, overrides: Sequence[str]) -> list[dict[str, Any]]:
    """[RayJob, RayCluster] for ``config``, composed from ``overrides`` (which become the job's entrypoint)."""
    import yaml

    la = config.launch
    if config.ray.address:
        raise ConfigError("ray.address", config.ray.address, "on KubeRay the driver joins the cluster KubeRay "
                          "creates for it (RAY_ADDRESS)", "remove the override")
    name = la.name or k8s_name(config.trainer.experiment_name)
    folder, pins = run_folder(config, overrides, name)
    labels = {"app.kubernetes.io/name": "easytrain", "app.kubernetes.io/instance": name}
    metadata = {"name": name, "namespace": la.namespace, "labels": labels}
    job_spec: dict[str, Any] = {
        "entrypoint": entrypoint(overrides, pins),
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": la.ttl_seconds_after_finished,
        "backoffLimit": la.backoff_limit,
    }
    if la.pip:
        job_spec["runtimeEnvYAML"] = yaml.safe_dump({"pip": list(la.pip)}, sort_keys=False)
    spec = cluster_spec(config, labels)
    job_spec["rayClusterSpec"] = spec
    logger.info("KubeRay %s: %d node(s) x %d worker(s) on %s, run folder %s", name, config.trainer.nnodes,
                config.trainer.workers_per_node, config.trainer.device, folder)
    return [
        {"apiVersion": API_VERSION, "kind": "RayJob", "metadata": copy.deepcopy(metadata), "spec": job_spec},
        {"apiVersion": API_VERSION, "kind": "RayCluster", "metadata": copy.deepcopy(metadata),
         "spec": copy.deepcopy(spec)},
    ]


def to_yaml(manifests: Sequence[dict[str, Any]]) -> str:
    """YAML documents, each starting with ``---``."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # a dict used twice is written twice, never as &anchor
            return True

    return yaml.dump_all(list(manifests), Dumper=Dumper, sort_keys=False, explicit_start=True, width=4096)


# ----------------------------------------------------------------------------- apply


def kubeconfig_files() -> list[str]:
    """Existing kubeconfig files: those in ``KUBECONFIG``, else ``~/.kube/config``."""
    listed = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    return [p for p in (listed or [os.path.expanduser("~/.kube/config")]) if os.path.isfile(p)]


def apply(manifests: Sequence[dict[str, Any]], namespace: str) -> list[str]:
    """Create the manifests in ``namespace`` with the ``kubernetes`` client; returns ``kind/name`` of each."""
    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    if not kubeconfig_files() and not in_pod:
        raise KubeError("no kubeconfig (KUBECONFIG, ~/.kube/config) and not inside a pod: use --dry-run and "
                        "`kubectl apply -f -` where kubectl can reach the cluster")
    try:
        from kubernetes import client
        from kubernetes import config as kube_config
    except ImportError as err:
        raise KubeError("applying needs the kubernetes client: pip install kubernetes (the kuberay extra), "
                        "or use --dry-run and `kubectl apply -f -`") from err
    if kubeconfig_files():
        kube_config.load_kube_config()
    else:
        kube_config.load_incluster_config()
    api = client.CustomObjectsApi()
    created = []
    for manifest in manifests:
        group, version = manifest["apiVersion"].split("/")
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        try:
            api.create_namespaced_custom_object(group, version, namespace, PLURALS[kind], manifest)
        except client.exceptions.ApiException as err:
            if err.status == 409:
                raise KubeError(f"{kind} {name} already exists in namespace {namespace}: `kubectl delete "
                                f"{kind.lower()} {name} -n {namespace}`, or set launch.name") from err
            if err.status == 404:
                raise KubeError(f"the cluster does not know {kind} ({group}/{version}): install the KubeRay "
                                "operator (its CRDs)") from err
            raise KubeError(f"creating {kind} {name} in {namespace} failed: {err.status} {err.reason}") from err
        created.append(f"{PLURALS[kind][:-1]}.{group}/{name}")
        logger.info("created %s %s in namespace %s", kind, name, namespace)
    return created


def submit_kuberay(overrides: list[str], dry_run: bool, cluster: bool = False, out: TextIO = sys.stdout) -> int:
    """``easytrain submit --kuberay [--dry-run] [overrides]``.

    Renders from the validated config (a :class:`ConfigError` propagates: the CLI reports it in one line,
    exit 2) and prints (``dry_run``: YAML on ``out``, nothing else) or creates the RayJob, or with ``cluster``
    the long-lived RayCluster instead: what is printed is what would be created. Returns the exit code.
    """
    from easytrain.config import compose
    from easytrain.main import resolve

    config = resolve(compose(with_default_preset(list(overrides))), local_paths=False)  # paths are the pods' own
    job, raycluster = render(config, overrides)
    chosen = [raycluster if cluster else job]
    if dry_run:
        out.write(to_yaml(chosen))
        return 0
    try:
        created = apply(chosen, config.launch.namespace)
    except KubeError as err:
        sys.stderr.write(f"easytrain submit --kuberay: {err}\n")
        return 1
    out.write("".join(f"{what} created in namespace {config.launch.namespace}\n" for what in created))
    if not cluster:
        out.write(f"follow: kubectl get rayjob {job['metadata']['name']} -n {config.launch.namespace} -w\n")
    return 0


# ----------------------------------------------------------------------------- checked-in files


def file_text(manifest: dict[str, Any], overrides: Sequence[str]) -> str:
    """A manifest as written to ``launcher/kuberay/`` (a header saying how it was made, then the YAML)."""
    command = shlex.join(["python", "-m", "easytrain.launch.kuberay", "--out", "launcher/kuberay", *overrides])
    return (f"# {manifest['kind']} for {' '.join(overrides)}: generated by launcher/kuberay/render.sh\n"
            f"# ({command}); do not edit, re-render. tests/test_kuberay.py checks it is current.\n"
            + to_yaml([manifest]))


def write_files(overrides: Sequence[str], out_dir: Path) -> list[Path]:
    """Render ``overrides`` and write ``rayjob.yaml`` and ``raycluster.yaml`` into ``out_dir``."""
    from easytrain.config import load

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for manifest in render(load(with_default_preset(list(overrides))), overrides):
        path = out_dir / f"{manifest['kind'].lower()}.yaml"
        path.write_text(file_text(manifest, overrides))
        written.append(path)
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m easytrain.launch.kuberay", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for rayjob.yaml and raycluster.yaml")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides, e.g. +exp=qwen25vl_7b")
    args = parser.parse_args(argv)
    try:
        written = write_files(args.overrides, args.out)
    except ConfigError as err:
        sys.stderr.write(f"easytrain kuberay: config error: {err}\n")
        return 2
    sys.stdout.write("".join(f"{path}\n" for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
