"""bench/planner_accuracy.py's sampler: a process's peak between two samples is read from the kernel's
high-water mark, so a peak shorter than the sampling period is not missed (issue 47, item 5)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.planner_accuracy import peak_since_last_sample  # noqa: E402

MB = 2**20
PROGRAM = """
import sys
block = bytearray(256 * 2**20)  # 256 MiB, pages touched
del block                       # freed at once: a peak no later RSS sample sees
print("freed", flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc clear_refs")
def test_a_peak_between_samples_is_read_and_the_next_interval_starts_afresh() -> None:
    child = subprocess.Popen([sys.executable, "-c", PROGRAM], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "freed"
        rss = int(next(line for line in Path(f"/proc/{child.pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS:")).split()[1]) * 1024
        assert rss < 128 * MB  # the block is gone from the resident set
        assert peak_since_last_sample(child.pid) >= 256 * MB  # but the interval's peak held it
        assert peak_since_last_sample(child.pid) < 128 * MB  # reset: the next interval has no such peak
    finally:
        child.communicate("\n", timeout=30)
