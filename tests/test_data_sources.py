"""Row sources (issue 25, items 7 and 9): HF datasets read undecoded, so their images meet easytrain's checks;
parquet read a row group at a time, a few held, never the whole table in each process."""

from __future__ import annotations

import io
import pickle
import random
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from easytrain.config.schema import DataConfig, ModelConfig
from easytrain.data.dataset import PromptDataset
from easytrain.data.sources import ROW_GROUP_CACHE, ParquetSource, open_source
from easytrain.models.hf import load_tokenizer

datasets = pytest.importorskip("datasets")


def _png(size: tuple[int, int] = (60, 40), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Callable[..., Path]) -> Any:
    return load_tokenizer(ModelConfig(path=str(tiny_model("qwen2_5_vl"))))


def _image_rows() -> dict[str, list[Any]]:
    """Four rows: a good image, a corrupt one, a 100-MP bomb (a few KB as PNG), a good one."""
    images = [_png(), b"\x89PNG\r\n\x1a\n but not really", _png((10_000, 10_000), "1"), _png((80, 50))]
    return {"problem": [f"<image>What is shown in {i}?" for i in range(4)], "answer": [str(i) for i in range(4)],
            "image": [{"bytes": data, "path": None} for data in images]}


def test_hf_folder_with_a_corrupt_image_skips_that_row(tmp_path: Path, tokenizer: Any) -> None:
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict(_image_rows()).cast_column("image", datasets.Image()).save_to_disk(str(folder))
    dataset = PromptDataset([str(folder)], DataConfig(image_key="image"), tokenizer, progress=False)
    report = dataset.skips.as_dict()
    assert report["skipped"] == {"image_too_large": 1, "image_unreadable": 1} and report["kept"] == 2
    assert [dataset[i].answer for i in range(len(dataset))] == ["0", "3"]
    written = dataset.write_skip_report(tmp_path / "run").read_text()
    assert '"image_unreadable": 1' in written


def test_hf_data_files_folder_reads_its_own_image_files(tmp_path: Path, tokenizer: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An imagefolder keeps absolute paths to its files: they lie in the dataset's folder, so they are read."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    folder = tmp_path / "imagefolder" / "train"
    folder.mkdir(parents=True)
    (folder / "good.png").write_bytes(_png())
    (folder / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (folder / "metadata.csv").write_text("file_name,problem,answer\ngood.png,<image>what?,1\nbad.png,<image>what?,2\n")
    dataset = PromptDataset([str(tmp_path / "imagefolder")], DataConfig(image_key="image"), tokenizer, progress=False)
    assert len(dataset) == 1 and dataset[0].answer == "1"
    assert dataset.skips.as_dict()["skipped"] == {"image_unreadable": 1}


def test_hub_dataset_goes_through_the_same_checks(tmp_path: Path, tokenizer: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``repo@split`` (the hub, unreachable here: ``load_dataset`` stands in) reads undecoded like a folder; a
    path row may point into the HF caches, nowhere else."""
    cache = tmp_path / "hf-cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / "cached.png").write_bytes(_png())
    (tmp_path / "elsewhere.png").write_bytes(_png())
    rows = _image_rows()
    rows["problem"] += ["<image>cached?", "<image>elsewhere?"]
    rows["answer"] += ["4", "5"]
    rows["image"] += [{"bytes": None, "path": str(cache / "downloads" / "cached.png")},
                      {"bytes": None, "path": str(tmp_path / "elsewhere.png")}]
    hub = datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())
    asked: list[tuple[str, str]] = []

    def load_dataset(repo: str, split: str) -> Any:
        asked.append((repo, split))
        return hub

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    dataset = PromptDataset(["someone/figures@train"], DataConfig(image_key="image"), tokenizer, progress=False)
    assert asked == [("someone/figures", "train")]
    assert [dataset[i].answer for i in range(len(dataset))] == ["0", "3", "4"]
    assert dataset.skips.as_dict()["skipped"] == {"image_outside_dir": 1, "image_too_large": 1,
                                                  "image_unreadable": 1}


def _numbered_parquet(path: Path, rows: int, group_rows: int) -> Path:
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("images", pa.list_(image)), ("problem", pa.string()), ("answer", pa.string())])
    data = [{"images": [{"bytes": _png((40 + i % 7, 30)), "path": None}], "problem": f"<image>row {i}",
             "answer": str(i)} for i in range(rows)]
    pq.write_table(pa.Table.from_pylist(data, schema=schema), path, row_group_size=group_rows)
    return path


def test_parquet_is_read_a_few_row_groups_at_a_time(tmp_path: Path) -> None:
    path = _numbered_parquet(tmp_path / "many.parquet", rows=60, group_rows=5)
    assert pq.ParquetFile(path).metadata.num_row_groups == 12
    source = ParquetSource(str(path), cache_row_groups=3)
    assert len(source) == 60 and source.columns() == ["images", "problem", "answer"]
    assert source.cached_row_groups == 0  # opening reads the metadata only
    order = list(range(60)) * 2
    random.Random(0).shuffle(order)
    most = 0
    for index in order:
        row = source[index]
        assert isinstance(row, dict) and row["answer"] == str(index) and row["problem"] == f"<image>row {index}"
        assert Image.open(io.BytesIO(row["images"][0]["bytes"])).size == (40 + index % 7, 30)
        most = max(most, source.cached_row_groups)
    assert most == 3
    with pytest.raises(IndexError):
        source[60]


def test_a_pickled_parquet_source_carries_no_rows(tmp_path: Path) -> None:
    """What a spawned loader worker receives: the path and the row-group layout; it opens the file itself."""
    path = _numbered_parquet(tmp_path / "many.parquet", rows=60, group_rows=5)
    source = ParquetSource(str(path), cache_row_groups=2)
    for index in range(0, 60, 7):
        source[index]
    payload = pickle.dumps(source)
    assert len(payload) < 2_000 < path.stat().st_size
    copy = pickle.loads(payload)
    assert copy.cached_row_groups == 0 and len(copy) == 60
    assert [copy[i]["answer"] for i in (59, 0, 31)] == ["59", "0", "31"] and copy.cached_row_groups == 2


def test_dataset_over_a_parquet_larger_than_the_cache(tmp_path: Path, tokenizer: Any) -> None:
    path = _numbered_parquet(tmp_path / "many.parquet", rows=40, group_rows=2)
    dataset = PromptDataset([str(path)], DataConfig(), tokenizer, progress=False)
    source = dataset.sources[0]
    assert isinstance(source, ParquetSource) and source.cached_row_groups <= ROW_GROUP_CACHE < 20
    order = list(range(40))
    random.Random(1).shuffle(order)
    for index in order:
        assert dataset[index].answer == str(index)
        assert source.cached_row_groups <= ROW_GROUP_CACHE


def test_a_damaged_row_group_spoils_its_rows_only(tmp_path: Path, tokenizer: Any) -> None:
    path = _numbered_parquet(tmp_path / "many.parquet", rows=8, group_rows=4)
    meta = pq.ParquetFile(path).metadata
    column = meta.row_group(1).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start:start + column.total_compressed_size] = b"\xff" * column.total_compressed_size
    path.write_bytes(bytes(data))
    source = open_source(str(path))
    assert isinstance(source[0], dict)
    dataset = PromptDataset([str(path)], DataConfig(), tokenizer, progress=False)
    assert len(dataset) == 4 and dataset.skips.as_dict()["skipped"] == {"unreadable_row_group": 4}
