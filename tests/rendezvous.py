"""Where the spawned ranks of a test meet: a file, not a TCP port.

A port picked free and closed again can be taken before rank 0 listens on it (a CI run of 42f945e failed with
EADDRINUSE in tests/test_deepspeed.py); a FileStore in a fresh folder cannot collide with anything.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional


def rendezvous(folder: Optional[Path] = None) -> str:
    """A ``file://`` init_method for one process group, in a new folder (under ``folder`` when given)."""
    where = Path(tempfile.mkdtemp(prefix="rendezvous-", dir=folder))
    return f"file://{where / 'store'}"
