"""Data loader throughput and memory: samples/s with images, peak RSS per 1k samples, and the memory of a
parquet far larger than the loader's row-group cache.

    .venv/bin/python bench/data_loader.py            # writes bench/results/data_loader.json (~5 min on 2 cores)

Throughput, two workloads on the tiny Qwen2.5-VL tokenizer and image processor:
- ``synthetic``: the built-in shapes task (112-px PNGs, 16 vision tokens each);
- ``photo``: 640x480 JPEGs in the geometry3k parquet schema, max_pixels 401408
  (up to 512 vision tokens), closer to real VLM data.
For each, at two dataset sizes: the one-off check pass over every row (decode,
resize, template, count) and one epoch through the loader with 2 worker
processes (image processor in the workers), batch 16. RSS is sampled every
10 ms over the driver and its worker processes. Peak RSS is mostly fixed cost
(two worker processes importing torch and transformers); the memory that
grows with the data is the slope between the two sizes, reported as MB per
1k samples (a loader holding decoded images would show ~1 MB per sample).

Large parquet (``large_parquet``, issue 25 item 9): a parquet of random-noise
512x512 PNGs (incompressible, ~787 KB each; ~1.6 GB for the default 2000
rows) in row groups of 16 rows (~12.6 MB), over 30 times the row groups a
process caches (``easytrain.data.sources.ROW_GROUP_CACHE``). A fresh process
does what the trainer does with it: PromptDataset checks every row, then
PromptLoader (data.num_workers=2 spawned workers, the trainer's default)
serves ``--large-batches`` shuffled batches of 16 through the collator. RSS
is sampled every 10 ms per process. For comparison another fresh process
reads the file the way easytrain did before (``pq.read_table(memory_map=True)``,
once in every loader process): its RSS is what each process then held.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from easytrain.config.schema import DataConfig, ModelConfig  # noqa: E402
from easytrain.data.collate import PromptCollator  # noqa: E402
from easytrain.models.families.base import Bound  # noqa: E402
from easytrain.data.dataset import PromptDataset  # noqa: E402
from easytrain.data.loader import PromptLoader  # noqa: E402
from easytrain.data.sources import ROW_GROUP_CACHE, ParquetSource  # noqa: E402
from easytrain.data.synthetic import write_parquet  # noqa: E402
from easytrain.models.hf import family, load_image_processor, load_tokenizer  # noqa: E402
from easytrain.models.tiny import build_tiny  # noqa: E402

BATCH = 16
WORKERS = 2
LARGE_ROWS = 2000
GROUP_ROWS = 16
SIDE = 512
LARGE_BATCHES = 24
MB = 2**20


class RssSampler:
    """Peak RSS of this process plus its children, sampled on a thread."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def total(self) -> int:
        total = self.me.memory_info().rss
        for child in self.me.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.total())
            time.sleep(0.01)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class ProcessPeaks:
    """Peak RSS of this process and of each of its descendants, apart, sampled on a thread."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.driver = 0
        self.children: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.driver = max(self.driver, self.me.memory_info().rss)
            for child in self.me.children(recursive=True):
                try:
                    rss = child.memory_info().rss
                    name = " ".join(child.cmdline()[1:4])
                except psutil.Error:
                    continue
                self.children[child.pid] = (name, max(rss, self.children.get(child.pid, ("", 0))[1]))
            time.sleep(0.01)

    def workers(self) -> list[int]:
        """Peak RSS of each loader worker (not multiprocessing's small resource tracker), largest first."""
        return sorted((rss for name, rss in self.children.values() if "resource_tracker" not in name), reverse=True)

    def __enter__(self) -> "ProcessPeaks":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def noise_pngs(group: int) -> list[bytes]:
    """The images of one row group: random noise, so no compression shrinks the file (seeded by the group)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(group)
    images = []
    for _ in range(GROUP_ROWS):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(buffer, format="PNG",
                                                                                   compress_level=0)
        images.append(buffer.getvalue())
    return images


def noise_parquet(path: Path, rows: int) -> dict[str, Any]:
    """A geometry3k-schema parquet of ``rows`` noise PNGs written a row group at a time (never whole in memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("images", pa.list_(image)), ("problem", pa.string()), ("answer", pa.string())])
    start = time.perf_counter()
    groups = -(-rows // GROUP_ROWS)
    with multiprocessing.get_context("spawn").Pool(2) as pool, \
            pq.ParquetWriter(path, schema, compression="none", use_dictionary=False) as writer:
        for g, pngs in enumerate(pool.imap(noise_pngs, range(groups))):
            first = g * GROUP_ROWS
            count = min(GROUP_ROWS, rows - first)
            table = pa.Table.from_pylist([{"images": [{"bytes": pngs[i], "path": None}],
                                           "problem": f"<image>What is in picture {first + i}?",
                                           "answer": str((first + i) % 10)} for i in range(count)], schema=schema)
            writer.write_table(table, row_group_size=GROUP_ROWS)
    meta = pq.ParquetFile(path).metadata
    return {"rows": rows, "image": f"{SIDE}x{SIDE} random-noise PNG", "file_mb": round(path.stat().st_size / MB, 1),
            "row_groups": meta.num_row_groups, "rows_per_row_group": GROUP_ROWS,
            "row_group_mb": round(max(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)) / MB, 1),
            "build_s": round(time.perf_counter() - start, 1)}


def large_child(path: str, folder: str, batches: int) -> dict[str, Any]:
    """In a fresh process: the trainer's data path over the large parquet, with each process's peak RSS."""
    tokenizer = load_tokenizer(ModelConfig(path=folder))
    processor = load_image_processor(ModelConfig(path=folder))
    collator = PromptCollator(tokenizer.pad_token_id, Bound.of(family(folder), processor, tokenizer))
    baseline = psutil.Process().memory_info().rss
    with ProcessPeaks() as peaks:
        start = time.perf_counter()
        dataset = PromptDataset([path], DataConfig(), tokenizer, progress=False)
        check_s = time.perf_counter() - start
        after_check = peaks.me.memory_info().rss
        loader = PromptLoader(dataset, BATCH, collator, seed=0, num_workers=WORKERS)
        start = time.perf_counter()
        served = iter(loader)
        samples = sum(len(next(served)["uids"]) for _ in range(batches))
        serve_s = time.perf_counter() - start
        served.close()  # ends the workers
        source = dataset.sources[0]
        assert isinstance(source, ParquetSource)
        cached = source.cached_row_groups
    return {"rows_kept": len(dataset), "check_pass_s": round(check_s, 1),
            "check_pass_rows_per_s": round(len(dataset) / check_s, 1),
            "loader_batches": batches, "loader_samples": samples,
            "loader_samples_per_s_incl_worker_start": round(samples / serve_s, 1),
            "driver_cached_row_groups_after": cached,
            "driver_rss_before_data_mb": round(baseline / MB, 1),
            "driver_rss_after_check_pass_mb": round(after_check / MB, 1),
            "driver_peak_rss_mb": round(max(peaks.driver, after_check) / MB, 1),
            "worker_peak_rss_mb": [round(rss / MB, 1) for rss in peaks.workers()]}


def whole_table_child(path: str) -> dict[str, Any]:
    """In a fresh process: RSS of reading the file as easytrain did before (the whole table, memory-mapped)."""
    import pyarrow.parquet as pq

    before = psutil.Process().memory_info().rss
    with ProcessPeaks() as peaks:
        table = pq.read_table(path, memory_map=True)
        table.slice(0, 1).to_pylist()
        after = peaks.me.memory_info().rss
    return {"rss_before_mb": round(before / MB, 1), "rss_after_read_mb": round(after / MB, 1),
            "peak_rss_mb": round(max(peaks.driver, after) / MB, 1)}


def child(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench child {args[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def large_parquet(cache: str, folder: str, rows: int, batches: int) -> dict[str, Any]:
    path = Path(cache) / "noise.parquet"
    built = noise_parquet(path, rows)
    print(f"built {path}: {json.dumps(built)}", flush=True)
    measured = child("--large-child", str(path), folder, str(batches))
    before = child("--whole-table-child", str(path))
    path.unlink()
    file_mb = built["file_mb"]
    growth = measured["driver_peak_rss_mb"] - measured["driver_rss_before_data_mb"]
    return {**built, "cache_row_groups_per_process": ROW_GROUP_CACHE, "batch": BATCH, "num_workers": WORKERS,
            **measured, "driver_rss_growth_mb": round(growth, 1),
            "driver_rss_growth_over_file": round(growth / file_mb, 3),
            "whole_table_read_as_before": before,
            "whole_table_rss_over_file": round((before["rss_after_read_mb"] - before["rss_before_mb"]) / file_mb, 3)}


def photo_parquet(path: Path, rows: int) -> None:
    from PIL import Image, ImageDraw

    rng = random.Random(0)
    data = []
    for i in range(rows):
        image = Image.new("RGB", (640, 480), (rng.randint(0, 255), rng.randint(0, 255), rng.randint(0, 255)))
        draw = ImageDraw.Draw(image)
        for _ in range(12):
            x, y = rng.randint(0, 600), rng.randint(0, 440)
            draw.ellipse([x, y, x + rng.randint(10, 120), y + rng.randint(10, 120)],
                         fill=(rng.randint(0, 255), rng.randint(0, 255), rng.randint(0, 255)))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=85)
        data.append({"images": [{"bytes": buffer.getvalue(), "path": None}],
                     "problem": f"<image>Describe figure {i}.", "answer": str(i % 7), "question_type": "photo"})
    write_parquet(data, path)


def measure(files: list[str], cfg: DataConfig, tokenizer: Any, processor: Any, cache: str,
            folder: str) -> dict[str, float]:
    sampler = RssSampler()
    baseline = sampler.total()
    with sampler:
        start = time.perf_counter()
        dataset = PromptDataset(files, cfg, tokenizer, cache_dir=cache, progress=False)
        scan_s = time.perf_counter() - start
        collator = PromptCollator(tokenizer.pad_token_id, Bound.of(family(folder), processor, tokenizer))
        loader = PromptLoader(dataset, BATCH, collator, seed=0, num_workers=WORKERS)
        start = time.perf_counter()
        first = None
        samples = 0
        for batch in loader:
            if first is None:
                first = time.perf_counter()
            samples += len(batch["uids"])
        end = time.perf_counter()
    assert first is not None
    steady = (samples - BATCH) / (end - first) if end > first else float("nan")
    return {
        "rows": len(dataset), "check_pass_s": round(scan_s, 3),
        "check_pass_rows_per_s": round(len(dataset) / scan_s, 1),
        "epoch_s_incl_worker_start": round(end - start, 3),
        "samples_per_s_incl_worker_start": round(samples / (end - start), 1),
        "samples_per_s_steady": round(steady, 1),
        "peak_rss_mb": round(sampler.peak / 2**20, 1),
        "rss_above_baseline_mb": round((sampler.peak - baseline) / 2**20, 1),
    }


def throughput(cache: str, folder: str, tokenizer: Any, processor: Any) -> tuple[list[dict[str, Any]], dict]:
    results = []
    for rows in (500, 2000):
        cfg = DataConfig(synthetic_size=rows, shuffle=True)
        synthetic = measure(["synthetic:shapes"], cfg, tokenizer, processor, cache, folder)
        results.append({"workload": "synthetic", **synthetic})
        path = Path(cache) / f"photo-{rows}.parquet"
        photo_parquet(path, rows)
        cfg = DataConfig(max_pixels=401408, max_prompt_length=1024)
        results.append({"workload": "photo", **measure([str(path)], cfg, tokenizer, processor, cache, folder)})
        print(json.dumps(results[-2]), json.dumps(results[-1]), sep="\n", flush=True)
    slopes = {}
    for workload in ("synthetic", "photo"):
        small, large = [r for r in results if r["workload"] == workload]
        per_1k = (large["rows"] - small["rows"]) / 1000
        slopes[workload] = round((large["peak_rss_mb"] - small["peak_rss_mb"]) / per_1k, 1)
    return results, slopes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large-rows", type=int, default=LARGE_ROWS, help="rows of the large parquet")
    parser.add_argument("--large-batches", type=int, default=LARGE_BATCHES, help="loader batches served from it")
    parser.add_argument("--large-child", nargs=3, metavar=("PARQUET", "MODEL", "BATCHES"), help=argparse.SUPPRESS)
    parser.add_argument("--whole-table-child", metavar="PARQUET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.large_child:
        path, folder, batches = args.large_child
        print(json.dumps(large_child(path, folder, int(batches))))
        return
    if args.whole_table_child:
        print(json.dumps(whole_table_child(args.whole_table_child)))
        return

    cache = tempfile.mkdtemp(prefix="easytrain-bench-")
    try:
        folder = str(build_tiny("qwen2_5_vl", "tiny", 0, cache))
        tokenizer = load_tokenizer(ModelConfig(path=folder))
        processor = load_image_processor(ModelConfig(path=folder))
        results, slopes = throughput(cache, folder, tokenizer, processor)
        large = large_parquet(cache, folder, args.large_rows, args.large_batches)
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    record = {
        "benchmark": "data_loader",
        "settings": {"batch": BATCH, "num_workers": WORKERS, "model": "tiny:qwen2_5_vl"},
        "results": results,
        "peak_rss_growth_mb_per_1k_samples": slopes,
        "large_parquet": large,
    }
    out = ROOT / "bench" / "results" / "data_loader.json"
    write_result(out, record)
    print(f"{'workload':<10} {'rows':>5} {'check rows/s':>12} {'samples/s':>10} {'steady/s':>9} {'peak RSS MB':>11}")
    for r in results:
        print(f"{r['workload']:<10} {r['rows']:>5} {r['check_pass_rows_per_s']:>12} "
              f"{r['samples_per_s_incl_worker_start']:>10} {r['samples_per_s_steady']:>9} {r['peak_rss_mb']:>11}")
    for workload, slope in slopes.items():
        print(f"{workload}: peak RSS grows {slope} MB per 1k samples")
    print(f"large parquet: {large['file_mb']} MB, {large['row_groups']} row groups of {large['row_group_mb']} MB, "
          f"{large['cache_row_groups_per_process']} cached per process")
    print(f"  driver RSS {large['driver_rss_before_data_mb']} MB before the data, "
          f"peak {large['driver_peak_rss_mb']} MB "
          f"(+{large['driver_rss_growth_mb']} MB = {large['driver_rss_growth_over_file']:.1%} of the file); "
          f"workers' peaks {large['worker_peak_rss_mb']} MB")
    before = large["whole_table_read_as_before"]
    print(f"  read whole as before: {before['rss_before_mb']} -> {before['rss_after_read_mb']} MB "
          f"({large['whole_table_rss_over_file']:.0%} of the file), in each loader process")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
