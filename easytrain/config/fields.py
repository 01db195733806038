"""Per-field rules of the config schema: allowed choices and numeric ranges, kept in the dataclass field's
metadata (read by ``validate.check_fields`` and by the generated key reference)."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Optional

# Metadata keys read by validate.check_fields.
CHOICES = "choices"
LOW = "low"
HIGH = "high"
LOW_OPEN = "low_open"


def choice(default: str, *options: str) -> Any:
    """A string field restricted to ``options`` (the default must be one of them)."""
    assert default in options, (default, options)
    return field(default=default, metadata={CHOICES: options})


def bounded(default: Any, low: Optional[float] = None, high: Optional[float] = None,
            low_open: bool = False) -> Any:
    """A numeric field in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    return field(default=default, metadata={LOW: low, HIGH: high, LOW_OPEN: low_open})
