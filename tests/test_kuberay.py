"""KubeRay manifests: valid against KubeRay's CRDs strictly, and holding the values that matter.

The CRDs (``../shared/schemas/`` beside the repository) never set ``additionalProperties: false``, and the
API server silently prunes fields a structural schema does not define, so a misspelt field would vanish
rather than fail. Besides jsonschema on the ``v1`` ``openAPIV3Schema``, :func:`undefined_keys` walks each
manifest along the schema and reports every key the schema does not define (maps declared with
``additionalProperties`` and ``x-kubernetes-preserve-unknown-fields`` subtrees excepted; the root
``metadata``, which the CRD leaves to Kubernetes, is checked against ObjectMeta's common fields).
"""

from __future__ import annotations

import copy
import io
import os
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from easytrain.config import ConfigError, load
from easytrain.config.derived import ray_kill_threshold
from easytrain.launch.kuberay import (RAY_GID, RAY_UID, SECURITY_CONTEXT, file_text, render, secret_required,
                                     submit_kuberay, to_yaml)

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = Path(__file__).resolve().parents[2] / "shared" / "schemas"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
OBJECT_META = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "namespace": {"type": "string"}, "generateName": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
PRESET = ["+exp=qwen25vl_7b"]
CONFIGS = {
    "1node": PRESET,
    "2nodes": [*PRESET, "trainer.nnodes=2"],
    "4nodes_x8": [*PRESET, "trainer.nnodes=4", "trainer.workers_per_node=8", "launch.name=grpo-4x8",
                  "launch.auth_secret=ray-token", "+launch.env_vars.WANDB_MODE=offline", "launch.pip=[qwen-vl-utils]",
                  "launch.service_account=trainer", "launch.object_store_gb=100"],
    "3b_own_run_dir": ["+exp=qwen25vl_3b", "trainer.nnodes=2", "hydra.run.dir=/mnt/easytrain/exp/3b"],
    "cpu_tiny": ["+exp=tiny", "trainer.nnodes=2", "worker.actor.micro_batch_size_per_device_for_update=64",
                 "launch.worker_memory_gb=16", "launch.head_memory_gb=16"],
}


# ----------------------------------------------------------------------------- the strict checker


@pytest.fixture(scope="module")
def crds() -> dict[str, dict[str, Any]]:
    if not SCHEMAS.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {SCHEMAS} (the ../shared/schemas/ folder beside the repo)")
    out = {}
    for kind, name in CRD_FILES.items():
        crd = yaml.load((SCHEMAS / name).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
        schema["properties"]["metadata"] = OBJECT_META  # the CRD says only `type: object`: Kubernetes' ObjectMeta
        out[kind] = schema
    return out


def undefined_keys(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths of keys in ``value`` that ``schema`` does not define."""
    found: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        free = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key in props:
                found += undefined_keys(item, props[key], where)
            elif isinstance(extra, dict):
                found += undefined_keys(item, extra, where)
            elif not (extra is True or free):
                found.append(where)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += undefined_keys(item, schema["items"], f"{path}[{i}]")
    return found


def problems(manifest: dict[str, Any], crds: dict[str, dict[str, Any]]) -> list[str]:
    """Everything wrong with ``manifest`` for its CRD: jsonschema errors, then keys the schema lacks."""
    import jsonschema

    schema = crds[manifest["kind"]]
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
    return errors + [f"{path}: not defined by the CRD" for path in undefined_keys(manifest, schema)]


def rendered(overrides: list[str]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    config = load(overrides)
    job, cluster = render(config, overrides)
    return config, job, cluster


def test_checker_rejects_misspelt_fields(crds: dict[str, dict[str, Any]]) -> None:
    _, job, cluster = rendered(PRESET)
    assert problems(job, crds) == [] and problems(cluster, crds) == []
    bad = copy.deepcopy(job)
    bad["spec"]["shutdownAfterJobFinish"] = bad["spec"].pop("shutdownAfterJobFinishes")
    assert problems(bad, crds) == ["spec.shutdownAfterJobFinish: not defined by the CRD"]
    bad = copy.deepcopy(cluster)
    container = bad["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")
    container["resources"]["limits"]["nvidia.com/gpu"] = "8"  # a map: any resource name is fine
    assert problems(bad, crds) == [
        "spec.workerGroupSpecs[0].template.spec.containers[0].volumeMount: not defined by the CRD"]
    bad = copy.deepcopy(job)
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    bad["metadata"]["nmae"] = "x"
    found = problems(bad, crds)
    assert any("spec.rayClusterSpec.workerGroupSpecs.0.replicas" in p and "integer" in p for p in found), found
    assert "metadata.nmae: not defined by the CRD" in found
    bad = copy.deepcopy(cluster)
    bad["spec"]["authOptions"]["mode"] = "tokens"
    assert any("authOptions.mode" in p for p in problems(bad, crds))


def test_checker_allows_maps_and_preserved_subtrees() -> None:
    schema = {"type": "object", "properties": {
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
        "items": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
        "anything": {"type": "object", "additionalProperties": True},
    }}
    value = {"labels": {"x": "1"}, "free": {"a": 1, "b": {"c": 2}}, "anything": {"k": {"deep": 1}},
             "items": [{"name": "a"}, {"nmae": "b"}], "typo": 1}
    assert undefined_keys(value, schema) == ["items[1].nmae", "typo"]


# ----------------------------------------------------------------------------- the manifests


def _containers(cluster_spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    head = cluster_spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    worker = cluster_spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    return head, worker


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [str(k), *_strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [str(value)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_manifests_validate_and_hold_the_config(name: str, crds: dict[str, dict[str, Any]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    leaks = {"HF_TOKEN": "hf_leakcheck_0123456789", "WANDB_API_KEY": "wandb-leakcheck-42",
             "RAY_AUTH_TOKEN": "ray-leakcheck-77"}
    for key, value in leaks.items():  # credentials of the machine that renders never reach a manifest
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    overrides = CONFIGS[name]
    config, job, cluster = rendered(overrides)
    t, la = config.trainer, config.launch
    for manifest, kind in ((job, "RayJob"), (cluster, "RayCluster")):
        assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == kind
        assert problems(manifest, crds) == []
        assert not any(secret in s for s in _strings(manifest) for secret in leaks.values())
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == la.ttl_seconds_after_finished
    assert spec["backoffLimit"] == la.backoff_limit
    assert ("runtimeEnvYAML" in spec) == bool(la.pip)

    # entrypoint: the run with the same overrides (launch.* only shapes the manifests), on the shared volume
    words = shlex.split(spec["entrypoint"])
    kept = [o for o in overrides if not o.lstrip("+").startswith("launch.")]
    if name == "3b_own_run_dir":
        run_dir = t.output_dir
        assert run_dir == "/mnt/easytrain/exp/3b" and words == ["python", "-m", "easytrain.main", *kept]
    else:
        run_dir = f"{la.volume_mount_path}/runs/{job['metadata']['name']}"
        assert words == ["python", "-m", "easytrain.main", *kept, f"hydra.run.dir={run_dir}"]

    # head: no GPUs, runs the driver; one worker group of nnodes pods with the node's GPUs
    rc = spec["rayClusterSpec"]
    assert rc["authOptions"]["mode"] == "token"
    assert rc["authOptions"].get("secretName") == la.auth_secret
    assert rc["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    (group,) = rc["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == t.nnodes
    head, worker = _containers(rc)
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    if t.device == "cuda":
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == str(t.workers_per_node)
        assert group["rayStartParams"]["num-gpus"] == str(t.workers_per_node)
    else:
        assert "nvidia.com/gpu" not in worker["resources"]["limits"]
    assert worker["resources"]["requests"] == worker["resources"]["limits"]
    assert float(worker["resources"]["limits"]["cpu"]) >= t.workers_per_node
    for container in (head, worker):
        assert container["image"] == la.image

    # /dev/shm holds the object store; the shared volume holds the run folder and the HF cache
    for group_spec, container in ((rc["headGroupSpec"], head), (group, worker)):
        pod = group_spec["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory"
        store = int(group_spec["rayStartParams"]["object-store-memory"])
        assert _bytes(shm["sizeLimit"]) >= store > 0
        assert _bytes(shm["sizeLimit"]) <= _bytes(container["resources"]["limits"]["memory"]) / 2
        shared = [path for path, vol in mounts.items() if "persistentVolumeClaim" in volumes[vol]]
        assert len(shared) == 1 and volumes[mounts[shared[0]]]["persistentVolumeClaim"]["claimName"] == la.volume_claim
        assert os.path.commonpath([shared[0], run_dir]) == shared[0]
        env = {e["name"]: e for e in container["env"]}
        assert os.path.commonpath([shared[0], env["HF_HOME"]["value"]]) == shared[0]

        # Ray's memory monitor kills at the threshold the watchdog was checked against, above ram_hard
        threshold = env["RAY_memory_usage_threshold"]["value"]
        assert float(threshold) == ray_kill_threshold() == 0.95
        assert config.watchdog.ram_hard < float(threshold)
        assert int(env["RAY_memory_monitor_refresh_ms"]["value"]) > 0

        # credentials only through secretKeyRef, never a value; optional only where the run does without them
        for var, ref in la.secret_env.items():
            assert "value" not in env[var]
            selector = {"name": ref.split("/")[0], "key": ref.split("/")[1]}
            assert env[var]["valueFrom"]["secretKeyRef"] == (
                selector if secret_required(var, config) else {**selector, "optional": True})
        assert container["securityContext"] == SECURITY_CONTEXT
        for entry in container["env"]:
            if any(w in entry["name"] for w in ("TOKEN", "API_KEY", "SECRET", "PASSWORD")) \
                    and entry["name"] != "TOKENIZERS_PARALLELISM":
                assert set(entry) == {"name", "valueFrom"}, entry
        for var, value in la.env_vars.items():
            assert env[var]["value"] == value


def _bytes(quantity: str) -> float:
    units = {"G": 10**9, "M": 10**6, "Gi": 2**30, "Mi": 2**20}
    for suffix in sorted(units, key=len, reverse=True):
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * units[suffix]
    return float(quantity)


def test_memory_threshold_follows_the_environment_the_watchdog_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.97")
    _, job, _ = rendered(PRESET)
    for container in _containers(job["spec"]["rayClusterSpec"]):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["RAY_memory_usage_threshold"] == "0.97"
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.9")  # below watchdog.ram_hard=0.92: refused
    with pytest.raises(ConfigError, match=r"watchdog.ram_hard=0.92: must stay below Ray's memory kill threshold"):
        rendered(PRESET)


@pytest.mark.parametrize("overrides,key", [
    (["trainer.workers_per_node=0"], "trainer.workers_per_node"),
    (["trainer.nnodes=0"], "trainer.nnodes"),
    (["launch.worker_cpu=4"], "launch.worker_cpu"),
    (["trainer.output_dir=/data/run"], "trainer.output_dir"),
    (["hydra.run.dir=runs/here"], "trainer.output_dir"),
    (["launch.name=Bad_Name"], "launch.name"),
    (["launch.name=" + "a" * 48], "launch.name"),
    (["launch.secret_env.HF_TOKEN=no-key"], "launch.secret_env.HF_TOKEN"),
    (["+launch.env_vars.HF_TOKEN=hf_inline_secret"], "launch.env_vars.HF_TOKEN"),
    (["+launch.env_vars.RAY_memory_usage_threshold=0.99"], "launch.env_vars.RAY_memory_usage_threshold"),
    (["launch.object_store_gb=1500"], "launch.object_store_gb"),
    (["launch.worker_memory_gb=4096"], "launch.worker_memory_gb"),
    (["launch.worker_memory_gb=100", "launch.object_store_gb=45"], "launch.object_store_gb"),
    (["launch.volume_mount_path=relative"], "launch.volume_mount_path"),
    (["ray.address=ray://head:10001"], "ray.address"),
])
def test_invalid_settings_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        rendered([*PRESET, *overrides])
    assert err.value.key == key, str(err.value)
    assert "hf_inline_secret" not in str(err.value)


def test_pods_need_a_memory_size() -> None:
    with pytest.raises(ConfigError, match=r"^launch.worker_memory_gb=None: .*trainer.node_memory_gb"):
        rendered(["+exp=tiny"])


def test_checked_in_manifests_are_current(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    _, job, cluster = rendered(PRESET)
    for manifest, file in ((job, "rayjob.yaml"), (cluster, "raycluster.yaml")):
        path = REPO / "launcher" / "kuberay" / file
        assert path.read_text() == file_text(manifest, PRESET), \
            f"{path} is stale: re-render with `bash launcher/kuberay/render.sh`"
        assert list(yaml.safe_load_all(path.read_text())) == [manifest]


def test_dry_run_prints_only_yaml_of_what_would_be_created(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert submit_kuberay([*PRESET, "trainer.nnodes=2"], dry_run=True, out=out) == 0
    (job,) = yaml.safe_load_all(out.getvalue())
    assert job["kind"] == "RayJob" and job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] == 2
    assert out.getvalue() == to_yaml([job]) and out.getvalue().startswith("---\n")
    out = io.StringIO()
    assert submit_kuberay(PRESET, dry_run=True, cluster=True, out=out) == 0
    assert [d["kind"] for d in yaml.safe_load_all(out.getvalue())] == ["RayCluster"]
    # no kubeconfig: nothing is applied, and the message says what to do instead
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    out = io.StringIO()
    assert submit_kuberay(PRESET, dry_run=False, out=out) == 1
    assert out.getvalue() == "" and "--dry-run" in capsys.readouterr().err


def test_docker_image_matches_the_manifests() -> None:
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    default = load(PRESET).launch
    assert f"rayproject/ray:{default.ray_version}-" in dockerfile  # RayCluster spec.rayVersion = the image's Ray
    assert "scripts/install.sh gpu" in dockerfile
    install = (REPO / "scripts" / "install.sh").read_text()
    assert 'pip install --quiet -e "$here[$extras]"' in install and 'extras="$target"' in install  # .[gpu]
    ignored = (REPO / ".dockerignore").read_text().split()
    for entry in (".venv", ".git", "outputs", "**/__pycache__"):
        assert entry in ignored


# ----------------------------------------------------------------------------- secrets and privileges (issue 25, 14)


def _secret_refs(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """NAME -> secretKeyRef of every container, checked to be the same in each."""
    spec = manifest["spec"].get("rayClusterSpec", manifest["spec"])
    refs: dict[str, dict[str, Any]] = {}
    for container in _containers(spec):
        mine = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
        assert not refs or mine == refs
        refs = mine
    return refs


@pytest.mark.parametrize("overrides, required, optional", [
    # the preset's model is public (conf/model/): its token is optional; W&B is not a logger: its key is not needed
    (PRESET, set(), {"HF_TOKEN", "WANDB_API_KEY"}),
    # another Hub model may be gated: its token is required
    ([*PRESET, "model.path=someone/gated-vl"], {"HF_TOKEN"}, {"WANDB_API_KEY"}),
    ([*PRESET, "trainer.loggers=[console,wandb]"], {"WANDB_API_KEY"}, {"HF_TOKEN"}),
    ([*PRESET, "model.path=someone/gated-vl", "trainer.loggers=[console,wandb]",
      "+launch.env_vars.WANDB_MODE=offline"], {"HF_TOKEN"}, {"WANDB_API_KEY"}),
    ([*PRESET, "model.path=someone/gated-vl", "+launch.env_vars.HF_HUB_OFFLINE=1"], set(),
     {"HF_TOKEN", "WANDB_API_KEY"}),
    ([*PRESET, "~launch.secret_env.HF_TOKEN"], set(), {"WANDB_API_KEY"}),  # no token at all
    ([*PRESET, "+launch.secret_env.S3_KEY=s3-creds/secret"], {"S3_KEY"}, {"HF_TOKEN", "WANDB_API_KEY"}),
    (CONFIGS["cpu_tiny"], set(), {"HF_TOKEN", "WANDB_API_KEY"}),  # a model built here downloads nothing
])
def test_secrets_the_run_needs_are_required(overrides: list[str], required: set[str], optional: set[str],
                                            crds: dict[str, dict[str, Any]]) -> None:
    """A required Secret that is missing keeps the pods from starting with its name (`kubectl describe pod`);
    before, every secretKeyRef was optional, so a run needing one failed later with a 401."""
    _, job, cluster = rendered(overrides)
    for manifest in (job, cluster):
        assert problems(manifest, crds) == []
        refs = _secret_refs(manifest)
        assert {name for name, ref in refs.items() if "optional" not in ref} == required
        assert {name for name, ref in refs.items() if ref.get("optional") is True} == optional


def test_containers_run_unprivileged_as_the_images_user(crds: dict[str, dict[str, Any]]) -> None:
    _, job, cluster = rendered(CONFIGS["4nodes_x8"])
    for manifest in (job, cluster):
        assert problems(manifest, crds) == []
        spec = manifest["spec"].get("rayClusterSpec", manifest["spec"])
        for container in _containers(spec):
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True and context["runAsUser"] != 0
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"] == {"drop": ["ALL"]}
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users[-1] == f"{RAY_UID}:{RAY_GID}"  # the uid the manifests run as is the image's own
    for line in dockerfile.splitlines():
        if line.startswith("COPY --chown="):
            assert line.split()[1] == f"--chown={RAY_UID}:{RAY_GID}"
