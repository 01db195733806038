"""Per-field rules of the config schema: allowed choices and numeric ranges, kept in the dataclass field's
metadata (read by ``validate.check_fields`` and by the generated key reference); and :class:`Section`, the base of
every section, read-only once the loaded config is validated (:func:`freeze`)."""

from __future__ import annotations

from dataclasses import field, fields, is_dataclass
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


class Section:
    """A config section. Read-only once :func:`freeze` ran on the config holding it: a run's config is frozen
    when it is loaded and validated (its ``auto`` values resolved), so every process reads the same settings
    for the whole run. What the watchdog may change while a run goes (the update's micro batch) lives in
    :class:`easytrain.trainer.micro_batches.Forward` instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise AttributeError(f"the run's config is read-only once validated: {type(self).__name__}.{name} "
                                 "cannot change (set it at launch, or derive a changed copy with "
                                 "easytrain.config.with_overrides)")
        object.__setattr__(self, name, value)


def freeze(section: Any, frozen: bool = True) -> None:
    """Make ``section`` and every section inside it read-only (``frozen=False``: writable again, for a copy that
    :func:`easytrain.config.with_overrides` changes before freezing it)."""
    if not is_dataclass(section):
        return
    object.__setattr__(section, "_frozen", frozen)
    for f in fields(section):
        freeze(getattr(section, f.name), frozen)
