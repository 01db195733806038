"""What an entry of ``data.train_files`` / ``data.val_files`` names.

One classification for the two places that need it: the driver's path checks
(:mod:`easytrain.config.paths`: a wrong entry is one config error before anything
starts) and the sources that open the entry (:func:`easytrain.data.sources.open_source`).
An entry is ``synthetic:<task>``, a folder (an HF dataset), a ``.jsonl``/``.json``
or ``.parquet`` file, or a hub dataset written ``repo@split``. The grammar of a
synthetic task is here too; :mod:`easytrain.data.synthetic` generates its rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_TASK = "shapes"
QUESTION_TYPES = ("count", "largest", "colour")
"""The synthetic task's question types; ``synthetic:shapes/colour+count`` keeps a subset."""
VIDEO_TYPES = ("motion",)
"""Question types asked of a video (data.video_key=videos): named explicitly, never part of plain ``shapes``."""
TOOL_TYPES = ("dot",)
"""Question types meant for a tool (``+exp=tiny_tools``): named explicitly, never part of plain ``shapes``."""
FILE_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
"""File suffix -> how the file is read (a folder is an HF dataset)."""
KINDS = ("synthetic", "folder", "jsonl", "parquet", "unsupported", "hub", "missing")
"""What :func:`classify_data` says an entry is; ``unsupported``: a file of another type, ``missing``: none of
the others (no such file or folder, and not ``repo@split``)."""


@dataclass(frozen=True)
class DataSpec:
    """One data entry, classified."""

    kind: str
    """One of :data:`KINDS`."""
    spec: str
    """The entry as written."""
    target: str
    """What to open: the task (``synthetic``), the user-expanded path (files and folders), the entry (``hub``)."""
    suffix: str = ""
    """The file's lower-cased suffix (``jsonl``, ``parquet``, ``unsupported``)."""


def classify_data(spec: str) -> DataSpec:
    """Classify one data entry by its text and by what is on this machine's disk."""
    if spec.startswith(SYNTHETIC_PREFIX):
        return DataSpec("synthetic", spec, spec[len(SYNTHETIC_PREFIX):])
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return DataSpec("folder", spec, path)
    if os.path.isfile(path):
        suffix = os.path.splitext(path)[1].lower()
        return DataSpec(FILE_FORMATS.get(suffix, "unsupported"), spec, path, suffix)
    if "@" in spec and not spec.startswith(("/", "~", ".")):
        return DataSpec("hub", spec, spec)
    return DataSpec("missing", spec, path)


def parse_task(task: str) -> tuple[str, ...]:
    """``shapes`` (every question type) or ``shapes/colour`` / ``shapes/count+largest`` (a subset): the
    question types; a ValueError (problem; fix) for anything else."""
    name, _, wanted = task.partition("/")
    types = tuple(wanted.split("+")) if wanted else QUESTION_TYPES
    if name != SYNTHETIC_TASK or not set(types) <= set(QUESTION_TYPES + VIDEO_TYPES + TOOL_TYPES):
        raise ValueError(f"unknown synthetic task {task!r}; use {SYNTHETIC_TASK}, or {SYNTHETIC_TASK}/<types> with "
                         f"types from {', '.join(QUESTION_TYPES + VIDEO_TYPES + TOOL_TYPES)} joined by +")
    return types


def split_files(value: Any) -> Sequence[str]:
    """The list form of ``data.train_files`` / ``data.val_files`` (a string is one file)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)
