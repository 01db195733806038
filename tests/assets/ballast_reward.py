"""The spread reward of the resume tests, plus a ballast the watchdog tests drop into a reward worker.

``EASYTRAIN_TEST_BALLAST`` names a folder; a test writes a command file there and the first reward worker
to claim it (an atomic rename) allocates that much memory in 64 KiB blocks, inside a real easytrain
process:

- ``fragment_mb``: allocates and frees it again, keeping one block above the rest, so glibc holds the freed
  heap (RSS stays up) until someone calls ``malloc_trim``: what the watchdog's free_caches relief does. It
  rises at 1 GB/s: faster, the watchdog judges the rise itself as hard (its hard threshold comes down while
  memory grows fast: tests/test_pressure_flag.py);
- ``hold_mb``: allocates and keeps it (a leak no relief can free): the hard threshold's case;
- ``grow_mb``: ``TOTAL RATE`` - allocates TOTAL MB at RATE MB/s, in 32 MiB pieces, and keeps it: memory rising
  inside a step, which only a watchdog that acts while the reward runs can stop (and Ray's memory monitor
  kills for, past its line).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

BLOCK = 64 * 1024
_held: list[bytearray] = []


def _claim_text(name: str) -> str:
    folder = os.environ.get("EASYTRAIN_TEST_BALLAST")
    if not folder:
        return ""
    command = Path(folder) / name
    taken = command.with_name(f"{name}.taken.{os.getpid()}")
    try:
        os.rename(command, taken)
    except OSError:
        return ""
    return taken.read_text()


def _claim(name: str) -> int:
    return int(_claim_text(name) or 0)


def spread(responses: list[str], ground_truths: list[str]) -> list[dict[str, float]]:
    fragment_mb, hold_mb = _claim("fragment_mb"), _claim("hold_mb")
    if fragment_mb:
        blocks, start = [], time.monotonic()
        for i in range(fragment_mb * 2**20 // BLOCK):
            blocks.append(bytearray(BLOCK))
            if i % 512 == 511:  # 32 MiB, then keep to 1 GB/s
                time.sleep(max(0.0, start + (i + 1) * BLOCK / 2**30 - time.monotonic()))
        _held.append(bytearray(BLOCK))  # above the freed blocks: the heap cannot shrink from its top
        del blocks
    if hold_mb:
        _held.extend(bytearray(BLOCK) for _ in range(hold_mb * 2**20 // BLOCK))
    grow = _claim_text("grow_mb").split()
    if grow:
        total, rate = int(grow[0]), float(grow[1])
        piece, start = 32, time.monotonic()
        for i in range(1, total // piece + 1):
            _held.append(bytearray(piece * 2**20))  # zero-filled: resident at once
            time.sleep(max(0.0, start + i * piece / rate - time.monotonic()))
    return [{"overall": (sum(map(ord, r)) % 7) / 6.0} for r in responses]
