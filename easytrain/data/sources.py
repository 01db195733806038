"""Row sources: jsonl, parquet, HF datasets (local folders or ``repo@split``), synthetic tasks.

A source gives random access to raw rows as dicts without loading a file
into memory: jsonl by byte offsets (a bad line is a bad row, not a bad file),
parquet one row group at a time (a few kept, least recently used dropped),
HF datasets through ``datasets`` with their images left undecoded (easytrain
decodes and checks them like any other row's). A row that cannot be read
comes back as a :class:`BadSample`; a file that cannot be used at all
(missing, unreadable, a required column absent) raises :class:`DataError`
before training starts, naming the file and what to do.

Sources are pickled into data-loader worker processes: they carry paths and
offsets, never loaded data, and each process opens its own file handles.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, Union

from easytrain.config.data_spec import classify_data
from easytrain.data.images import BadSample

logger = logging.getLogger(__name__)

Row = Union[dict[str, Any], BadSample]

ROW_GROUP_CACHE = 4
"""Row groups of one parquet file a process keeps decoded (least recently used dropped): its memory for the
file is this many row groups, whatever the file's size."""
LARGE_ROW_GROUP_BYTES = 512 * 2**20
"""A parquet row group larger than this (uncompressed) is worth a warning: each loader process holds
ROW_GROUP_CACHE of them."""


class DataError(ValueError):
    """A data file that cannot be used at all; one line naming the file and the fix."""


class RowSource(Protocol):
    name: str
    image_roots: tuple[str, ...]
    """Folders besides data.image_dir that this source's image paths may lie in (an HF dataset's own)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Row: ...

    def columns(self) -> list[str]: ...


class JsonlSource:
    """A .jsonl file indexed by line offsets; each line is parsed when it is read."""

    image_roots: tuple[str, ...] = ()

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
    """A parquet file read one row group at a time, at most ``cache_row_groups`` of them held (LRU).

    A row's index maps to (row group, offset) through the file's metadata. The
    file is opened lazily in each process that reads it: a data-loader worker
    (spawned or forked) gets the path and the row-group layout, never a table.
    """

    image_roots: tuple[str, ...] = ()

    def __init__(self, path: str, cache_row_groups: int = ROW_GROUP_CACHE) -> None:
        self.name = path
        self.cache_row_groups = max(1, cache_row_groups)
        self._reset()
        try:
            parquet = self._parquet()
            meta = parquet.metadata
            self._columns: list[str] = list(parquet.schema_arrow.names)
        except Exception as err:
            raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from err
        self._starts = [0]
        biggest = 0
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            self._starts.append(self._starts[-1] + group.num_rows)
            biggest = max(biggest, group.total_byte_size)
        if biggest > LARGE_ROW_GROUP_BYTES:
            logger.warning("%s: row groups of up to %.1f GB; each data process holds up to %d of them: "
                           "write it with smaller row groups (pyarrow.parquet.write_table(..., row_group_size=100))",
                           path, biggest / 1e9, self.cache_row_groups)

    def _reset(self) -> None:
        self._file: Any = None
        self._pid = -1
        self._cache: OrderedDict[int, Any] = OrderedDict()
        self._failed: dict[int, BadSample] = {}

    def _parquet(self) -> Any:
        """This process's handle on the file (a forked worker must not share its parent's)."""
        if self._file is None or self._pid != os.getpid():
            import pyarrow.parquet as pq

            self._cache.clear()
            self._file, self._pid = pq.ParquetFile(self.name, memory_map=False), os.getpid()
        return self._file

    def __getstate__(self) -> dict[str, Any]:  # a loader worker opens the file itself; no table travels
        return {"name": self.name, "cache_row_groups": self.cache_row_groups, "starts": self._starts,
                "columns": self._columns}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name, self.cache_row_groups = state["name"], state["cache_row_groups"]
        self._starts, self._columns = state["starts"], state["columns"]
        self._reset()

    @property
    def cached_row_groups(self) -> int:
        """Row groups held in memory now."""
        return len(self._cache)

    def _row_group(self, group: int) -> Any:
        table = self._cache.get(group)
        if table is not None:
            self._cache.move_to_end(group)
            return table
        table = self._parquet().read_row_group(group)
        self._cache[group] = table
        while len(self._cache) > self.cache_row_groups:
            self._cache.popitem(last=False)
        return table

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> Row:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}: row {index} of {len(self)}")
        group = bisect.bisect_right(self._starts, index) - 1
        if group in self._failed:
            return self._failed[group]
        try:
            table = self._row_group(group)
        except Exception as err:  # a damaged row group spoils its rows, not the file
            self._failed[group] = BadSample("unreadable_row_group", f"row group {group}: {type(err).__name__}: {err}")
            return self._failed[group]
        return table.slice(index - self._starts[group], 1).to_pylist()[0]

    def columns(self) -> list[str]:
        return list(self._columns)


class HFSource:
    """A ``datasets.Dataset`` (a saved folder, local files, or a hub ``repo@split``), read as stored.

    Rows come in Arrow form, so image columns stay ``{"bytes", "path"}`` (nested
    in lists too) and easytrain decodes and checks them like a parquet row's: a
    corrupt image is a counted skip and the pixel limit applies, where
    ``datasets`` would decode it (and raise) itself.
    """

    def __init__(self, dataset: Any, name: str, image_roots: Sequence[str] = ()) -> None:
        self.name = name
        self.image_roots = tuple(image_roots)
        self._dataset = dataset.with_format("arrow")

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> Row:
        return self._dataset[index].to_pylist()[0]

    def columns(self) -> list[str]:
        return list(self._dataset.column_names)


def _hf_folder(path: Path) -> HFSource:
    import datasets

    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            split = "train" if "train" in loaded else next(iter(loaded))
            loaded = loaded[split]
        return HFSource(loaded, str(path), image_roots=(os.path.realpath(path),))
    return HFSource(datasets.load_dataset(str(path), split="train"), str(path), image_roots=(os.path.realpath(path),))


def _hub(spec: str) -> HFSource:
    import datasets

    repo, split = spec.rsplit("@", 1)
    try:
        dataset = datasets.load_dataset(repo, split=split)
    except Exception as err:
        raise DataError(f"{spec}: could not load hub dataset {repo!r} split {split!r} "
                        f"({type(err).__name__}: {err}); check the name, the split and network access") from err
    return HFSource(dataset, spec, image_roots=hf_caches())


def hf_caches() -> tuple[str, ...]:
    """Where ``datasets`` keeps a hub dataset's files: image paths of its rows may point there."""
    import datasets
    from huggingface_hub import constants

    return (str(datasets.config.HF_DATASETS_CACHE), str(constants.HF_HUB_CACHE))


def open_source(spec: str, cache_dir: Optional[str] = None, seed: int = 0, split: str = "train",
                text_only: bool = False, synthetic_size: int = 512, difficulty: int = 1) -> RowSource:
    """Open one entry of ``data.train_files`` / ``data.val_files`` (classified by
    :func:`easytrain.config.data_spec.classify_data`, as the driver's path checks do)."""
    entry = classify_data(spec)
    if entry.kind == "synthetic":
        from easytrain.data.synthetic import ensure_synthetic

        path = ensure_synthetic(entry.target, split, synthetic_size, seed, difficulty,
                                text_only=text_only, cache_dir=cache_dir)
        return ParquetSource(str(path))
    if entry.kind == "folder":
        return _hf_folder(Path(entry.target))
    if entry.kind == "jsonl":
        return JsonlSource(entry.target)
    if entry.kind == "parquet":
        return ParquetSource(entry.target)
    if entry.kind == "unsupported":
        raise DataError(f"{spec}: unsupported file type {entry.suffix!r}; use .jsonl, .parquet or a dataset folder")
    if entry.kind == "hub":
        return _hub(spec)
    raise DataError(f"{spec}: no such file or folder (a hub dataset is written repo@split)")


def local_rows(specs: Sequence[str], synthetic_size: int) -> Optional[int]:
    """Rows of the data entries ``specs`` when every one is on this machine (a parquet file's footer, a jsonl
    file's non-empty lines, a saved dataset folder's length, a synthetic task's ``synthetic_size``); None when
    one is a hub dataset or cannot be opened (counting it would download or fail: the caller assumes a bound)."""
    total = 0
    for spec in specs:
        entry = classify_data(spec)
        if entry.kind == "synthetic":
            total += synthetic_size
            continue
        if entry.kind not in ("parquet", "jsonl", "folder"):
            return None
        try:
            total += len(open_source(spec))
        except (DataError, OSError, ValueError) as err:
            logger.debug("%s: rows not counted (%s)", spec, err)
            return None
    return total


def require_columns(source: RowSource, keys: Sequence[tuple[str, Optional[str]]]) -> None:
    """Raise DataError naming the file, the missing column, the config key and the columns that exist."""
    columns = source.columns()
    for config_key, column in keys:
        if column is not None and column not in columns:
            raise DataError(f"{source.name}: no column {column!r} (set by {config_key}); "
                            f"the file has: {', '.join(columns) or 'no readable rows'}")
