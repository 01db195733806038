"""The Ray Jobs upload leaves out what the Docker build context does (issue 25, item 12).

Before, ``easytrain submit`` uploaded ``.env``, ``auth_token`` files, ``.ray``, ``wandb`` and ``mlruns`` folders
that ``.dockerignore`` keeps out. ``jobs.EXCLUDES`` is now the ``.dockerignore`` list, and Ray's own packer
(the function that zips the working directory, with the same gitignore matcher) shows what travels.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from easytrain.launch.jobs import EXCLUDES, UPLOAD_ONLY_EXCLUDES, runtime_env

ROOT = Path(__file__).resolve().parents[1]

LEFT_OUT = [
    ".env", "prod.env", "conf/.env", "deploy/staging.env",                  # credentials
    "auth_token", ".ray/auth_token", "launcher/secrets/auth_token", ".ray/session_latest/logs/raylet.out",
    "wandb/run-1/files/config.yaml", "outputs/2026/wandb/run-2/x.log",      # trackers' local runs
    "mlruns/0/meta.yaml", "runs/exp/mlruns/1/meta.yaml",
    ".venv/bin/python", ".git/config", "outputs/x/metrics.jsonl", "runs/a/checkpoints/global_step_1/actor/x",
    "model.safetensors", "sub/weights.pt", "sub/pytorch_model.bin", "easytrain/__pycache__/cli.cpython-311.pyc",
    "runs/exp/tensorboard/events.out.tfevents.1.host", "bench/results/memory.png", ".gpu/x", ".probe/y",
]
KEPT = ["pyproject.toml", "README.md", "easytrain/__init__.py", "easytrain/cli.py", "conf/config.yaml",
        "conf/exp/tiny.yaml", "scripts/install.sh", "bench/results/data_loader.json", "launcher/multinode.sh",
        "tests/assets/reward.py", "docs/security.md"]


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def uploaded(folder: Path, tmp: Path) -> set[str]:
    """The files Ray's packer puts in the working_dir zip for ``folder`` with the job's ``excludes``."""
    from ray._private.runtime_env.packaging import _zip_files

    package = tmp / "package.zip"
    _zip_files(str(folder), runtime_env(None, str(folder))["excludes"], str(package), include_gitignore=False)
    with zipfile.ZipFile(package) as z:
        return {name for name in z.namelist() if not name.endswith("/")}


def test_the_upload_excludes_are_the_dockerignore_line_by_line() -> None:
    assert EXCLUDES == dockerignore()
    assert runtime_env(None, "/w")["excludes"] == EXCLUDES + UPLOAD_ONLY_EXCLUDES


def test_rays_packer_leaves_out_credentials_and_local_state(tmp_path: Path) -> None:
    work = tmp_path / "work"
    for name in LEFT_OUT + KEPT:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("x")
    sent = uploaded(work, tmp_path)
    assert sorted(sent) == sorted(KEPT)


def test_the_repository_upload_keeps_what_the_job_runs(tmp_path: Path) -> None:
    """Ray matches a pattern without ``/`` at any depth (``build``, ``runs``): nothing the job needs is lost."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    needed = {f for f in tracked if f.split("/")[0] in ("easytrain", "conf", "scripts", "launcher")
              or f in ("pyproject.toml", "README.md")}
    assert needed and not needed - uploaded(ROOT, tmp_path)
