"""Row sources: jsonl, parquet, HF datasets (local folders or ``repo@split``), synthetic tasks.

A source gives random access to raw rows as dicts without loading a file
into memory: jsonl by byte offsets (a bad line is a bad row, not a bad file),
parquet memory-mapped through pyarrow, HF datasets through ``datasets``. A
row that cannot be read comes back as a :class:`BadSample`; a file that
cannot be used at all (missing, unreadable, a required column absent) raises
:class:`DataError` before training starts, naming the file and what to do.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, Union

from easytrain.data.images import BadSample

logger = logging.getLogger(__name__)

Row = Union[dict[str, Any], BadSample]


class DataError(ValueError):
    """A data file that cannot be used at all; one line naming the file and the fix."""


class RowSource(Protocol):
    name: str

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Row: ...

    def columns(self) -> list[str]: ...


class JsonlSource:
    """A .jsonl file indexed by line offsets; each line is parsed when it is read."""

    def __init__(self, path: str) -> None:
        self.name = path
        self._offsets: list[int] = []
        with open(path, "rb") as f:
            offset = 0
            for line in f:
                if line.strip():
                    self._offsets.append(offset)
                offset += len(line)

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> Row:
        with open(self.name, "rb") as f:
            f.seek(self._offsets[index])
            raw = f.readline()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            return BadSample("bad_text", f"not UTF-8 at byte {err.start}")
        try:
            row = json.loads(text)
        except json.JSONDecodeError as err:
            return BadSample("bad_json", str(err))
        return row if isinstance(row, dict) else BadSample("bad_json", "line is not a JSON object")

    def columns(self) -> list[str]:
        keys: dict[str, None] = {}
        for i in range(min(len(self), 20)):
            row = self[i]
            if isinstance(row, dict):
                keys.update(dict.fromkeys(row))
        return list(keys)


class ParquetSource:
    """A parquet file, memory-mapped; rows are materialised one at a time."""

    def __init__(self, path: str) -> None:
        self.name = path
        self._open()

    def _open(self) -> None:
        import pyarrow.parquet as pq

        path = self.name
        try:
            self._table = pq.read_table(path, memory_map=True)
        except Exception as err:
            raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from err

    def __getstate__(self) -> dict[str, Any]:  # data-loader workers re-map the file instead of copying it
        return {"name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name = state["name"]
        self._open()

    def __len__(self) -> int:
        return self._table.num_rows

    def __getitem__(self, index: int) -> Row:
        return self._table.slice(index, 1).to_pylist()[0]

    def columns(self) -> list[str]:
        return list(self._table.column_names)


class HFSource:
    """A ``datasets.Dataset`` (a saved folder, local files, or a hub ``repo@split``)."""

    def __init__(self, dataset: Any, name: str) -> None:
        self.name = name
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> Row:
        return dict(self._dataset[index])

    def columns(self) -> list[str]:
        return list(self._dataset.column_names)


def _hf_folder(path: Path) -> HFSource:
    import datasets

    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            split = "train" if "train" in loaded else next(iter(loaded))
            loaded = loaded[split]
        return HFSource(loaded, str(path))
    return HFSource(datasets.load_dataset(str(path), split="train"), str(path))


def _hub(spec: str) -> HFSource:
    import datasets

    repo, split = spec.rsplit("@", 1)
    try:
        return HFSource(datasets.load_dataset(repo, split=split), spec)
    except Exception as err:
        raise DataError(f"{spec}: could not load hub dataset {repo!r} split {split!r} "
                        f"({type(err).__name__}: {err}); check the name, the split and network access") from err


def open_source(spec: str, cache_dir: Optional[str] = None, seed: int = 0, split: str = "train",
                text_only: bool = False, synthetic_size: int = 512, difficulty: int = 1) -> RowSource:
    """Open one entry of ``data.train_files`` / ``data.val_files``."""
    if spec.startswith("synthetic:"):
        from easytrain.data.synthetic import ensure_synthetic

        path = ensure_synthetic(spec[len("synthetic:"):], split, synthetic_size, seed, difficulty,
                                text_only=text_only, cache_dir=cache_dir)
        return ParquetSource(str(path))
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        return _hf_folder(path)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            return JsonlSource(str(path))
        if suffix == ".parquet":
            return ParquetSource(str(path))
        raise DataError(f"{spec}: unsupported file type {suffix!r}; use .jsonl, .parquet or a dataset folder")
    if "@" in spec:
        return _hub(spec)
    raise DataError(f"{spec}: no such file or folder (a hub dataset is written repo@split)")


def require_columns(source: RowSource, keys: Sequence[tuple[str, Optional[str]]]) -> None:
    """Raise DataError naming the file, the missing column, the config key and the columns that exist."""
    columns = source.columns()
    for config_key, column in keys:
        if column is not None and column not in columns:
            raise DataError(f"{source.name}: no column {column!r} (set by {config_key}); "
                            f"the file has: {', '.join(columns) or 'no readable rows'}")
