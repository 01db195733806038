"""The spread reward of the resume tests, misbehaving once on request: ``EASYTRAIN_TEST_FAULT`` names a folder,
a test writes a command file there (``raises``, ``hangs``, ``nan``) and the first reward call to claim it (an
atomic rename) raises or scores its responses NaN (on that call and the next ones, as many calls as the
file's number says: the pool retries each response of a failed call alone), or sleeps for an hour."""

from __future__ import annotations

import os
import time
from pathlib import Path


_left = {"raises": 0, "nan": 0}


def _claim(name: str) -> str:
    folder = os.environ.get("EASYTRAIN_TEST_FAULT")
    if not folder:
        return ""
    taken = Path(folder) / f"{name}.taken.{os.getpid()}"
    try:
        os.rename(Path(folder) / name, taken)
    except OSError:
        return ""
    return taken.read_text() or "1"


def spread(responses: list[str], ground_truths: list[str]) -> list[dict[str, float]]:
    for mode in _left:
        _left[mode] += int(_claim(mode) or 0)
    if _left["raises"] > 0:
        _left["raises"] -= 1
        raise RuntimeError("injected: the reward function raises")
    if _claim("hangs"):
        time.sleep(3600)
    nan = _left["nan"] > 0
    _left["nan"] -= nan
    return [{"overall": float("nan") if nan else (sum(map(ord, r)) % 7) / 6.0} for r in responses]
