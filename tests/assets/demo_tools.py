"""Tools for tests/test_tools.py: one described in full, and ones that raise, hang, flood, draw, crash."""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any, List, Optional

_RUN = uuid.uuid4().hex
"""New each time this file runs: tools of one file should share one run."""


def zoom(x: int, y: int, scale: float = 2.0, label: Optional[str] = None, tags: Optional[List[str]] = None) -> str:
    """Zoom into the image around a point.

    The crop is square.

    Args:
        x: column of the centre, in pixels.
        y (int): row of the centre,
            in pixels.
        scale: how much to enlarge.

    Returns:
        A description of the crop.
    """
    return f"zoomed {scale}x at ({x}, {y})" + (f" [{label}]" if label else "")


def undocumented(a, b=1, *, c: dict = None, flag: bool = False):  # type: ignore[no-untyped-def,assignment]
    return a


def spread(*values: int) -> int:
    """Takes any number of values."""
    return sum(values)


def fails(message: str) -> str:
    """Raises with ``message``."""
    raise ValueError(message)


def sleeps() -> str:
    """Never answers."""
    time.sleep(3600)
    return "late"


def big(n: int) -> str:
    """``n`` characters."""
    return "x" * n


def table() -> dict[str, Any]:
    """A dict, sent as JSON."""
    return {"shapes": ["circle", "square"], "n": 2}


def picture(size: int = 8) -> list[Any]:
    """A red square and its caption."""
    from PIL import Image

    return [Image.new("RGB", (size, size), (255, 0, 0)), "a red square"]


def crash(code: int = 1) -> str:
    """Takes its process down."""
    os._exit(code)


def pid() -> int:
    """The tool process's id."""
    return os.getpid()


def heavy_modules() -> list[str]:
    """Heavy modules loaded in the tool process (there should be none)."""
    return [name for name in ("torch", "ray", "transformers", "easytrain.workers", "easytrain.trainer",
                              "easytrain.config") if name in sys.modules]


def run_id() -> str:
    """Which run of this file the tool lives in."""
    return _RUN


def run_id_again() -> str:
    """The same, from another tool."""
    return _RUN


def exits(code: int = 2) -> str:
    """Calls sys.exit."""
    sys.exit(code)
