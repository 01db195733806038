"""Does this node's NVIDIA driver run the installed torch's CUDA build? Run by ``scripts/install.sh gpu``.

    python scripts/check_driver.py [--torch-cuda 13.0]   # exit 0 fine, 1 with what to do

The driver says which CUDA version it supports (``nvidia-smi``'s header, "CUDA Version: X.Y"); the torch wheel
says which CUDA it was built for (``torch.version.cuda``). CUDA's minor-version compatibility lets a build for
X.b run on a driver for X.a, so the majors must match or the driver's be newer; a lower minor is said as a
warning. Only the standard library and torch are imported: it runs before easytrain is installed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from typing import Optional

DRIVER_FOR = {12: "525.60.13", 13: "580.65.06"}
"""The oldest Linux driver that runs each CUDA major under minor-version compatibility (NVIDIA's CUDA Toolkit
release notes)."""


def driver_cuda() -> tuple[Optional[tuple[int, int]], str]:
    """(the CUDA version the driver supports, the driver version) from ``nvidia-smi``; (None, why) without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "no nvidia-smi on PATH: no NVIDIA driver is installed (or it is not on PATH)"
    try:
        out = subprocess.run([smi], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"nvidia-smi failed: {err}"
    cuda = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out)
    driver = re.search(r"Driver Version:\s*([\d.]+)", out)
    if cuda is None:
        return None, "nvidia-smi printed no 'CUDA Version': the driver is not running (reboot, or reinstall it)"
    return (int(cuda.group(1)), int(cuda.group(2))), driver.group(1) if driver else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-cuda", help="the CUDA version to check for (default: the installed torch's)")
    args = parser.parse_args()
    built = args.torch_cuda
    if built is None:
        import torch

        built = torch.version.cuda
        if built is None:
            print(f"check_driver: torch {torch.__version__} is a CPU build; install.sh gpu needs a CUDA one "
                  "(pip install torch from PyPI on Linux x86_64, not the +cpu wheel)", file=sys.stderr)
            return 1
    need = tuple(int(part) for part in built.split(".")[:2])
    have, driver = driver_cuda()
    if have is None:
        print(f"check_driver: {driver}; torch is built for CUDA {built}, which needs an NVIDIA driver >= "
              f"{DRIVER_FOR.get(need[0], '?')}", file=sys.stderr)
        return 1
    if have[0] < need[0]:
        print(f"check_driver: the NVIDIA driver {driver} supports CUDA {have[0]}.{have[1]}, torch is built for CUDA "
              f"{built}: update the driver to >= {DRIVER_FOR.get(need[0], '?')} (CUDA {need[0]}.x), or install a "
              f"torch built for CUDA {have[0]}.x", file=sys.stderr)
        return 1
    if have[0] == need[0] and have[1] < need[1]:
        print(f"check_driver: warning: the driver supports CUDA {have[0]}.{have[1]}, torch is built for {built}: it "
              "runs under CUDA's minor-version compatibility; a driver for the newer minor avoids its limits",
              file=sys.stderr)
    print(f"check_driver: NVIDIA driver {driver} (CUDA {have[0]}.{have[1]}) runs torch's CUDA {built} build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
