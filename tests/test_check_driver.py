"""Issue 23 item 6: `scripts/install.sh gpu` checks the NVIDIA driver against torch's CUDA build
(`scripts/check_driver.py`), here against a stand-in `nvidia-smi` that prints what a driver prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_driver.py"
HEADER = ("| NVIDIA-SMI {driver}             Driver Version: {driver}     CUDA Version: {cuda}     |\n"
          "|-----------------------------------------+------------------------+----------------------+\n")


def check(tmp_path: Path, torch_cuda: str, driver: Optional[str], cuda: Optional[str]) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    if driver is not None:
        text = HEADER.format(driver=driver, cuda=cuda) if cuda else "NVIDIA-SMI has failed: couldn't communicate\n"
        lines = " ".join(f"'{line}'" for line in text.splitlines())
        smi.write_text(f"#!/bin/sh\nprintf '%s\\n' {lines}\n")  # a shell builtin: PATH holds nothing else
        smi.chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir)}  # only the stand-in (or nothing) on PATH
    return subprocess.run([sys.executable, str(SCRIPT), "--torch-cuda", torch_cuda], capture_output=True,
                          text=True, env=env, timeout=60)


@pytest.mark.parametrize("driver, cuda", [("580.95.05", "13.0"), ("590.44.01", "13.1")])
def test_a_driver_for_the_same_or_a_newer_cuda_passes(tmp_path: Path, driver: str, cuda: str) -> None:
    done = check(tmp_path, "13.0", driver, cuda)
    assert done.returncode == 0, done.stderr
    assert f"NVIDIA driver {driver} (CUDA {cuda}) runs torch's CUDA 13.0 build" in done.stdout


def test_an_older_driver_says_which_to_install(tmp_path: Path) -> None:
    done = check(tmp_path, "13.0", "550.54.15", "12.4")
    assert done.returncode == 1
    assert ("the NVIDIA driver 550.54.15 supports CUDA 12.4, torch is built for CUDA 13.0: update the driver to "
            ">= 580.65.06 (CUDA 13.x), or install a torch built for CUDA 12.x") in done.stderr


def test_a_lower_minor_is_a_warning_only(tmp_path: Path) -> None:
    done = check(tmp_path, "12.8", "550.54.15", "12.4")
    assert done.returncode == 0 and "warning: the driver supports CUDA 12.4" in done.stderr


def test_no_driver_or_a_stopped_one_is_named(tmp_path: Path) -> None:
    missing = check(tmp_path, "12.8", None, None)
    assert missing.returncode == 1 and "no nvidia-smi on PATH" in missing.stderr and ">= 525.60.13" in missing.stderr
    stopped = check(tmp_path, "12.8", "550.54.15", None)
    assert stopped.returncode == 1 and "the driver is not running" in stopped.stderr


@pytest.mark.skipif(__import__("torch").version.cuda is not None, reason="a CUDA torch is installed here")
def test_a_cpu_torch_is_refused_for_a_gpu_install() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "is a CPU build; install.sh gpu needs a CUDA one" in done.stderr
