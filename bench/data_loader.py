"""Data loader throughput and memory: samples/s with images, and peak RSS per 1k samples.

    .venv/bin/python bench/data_loader.py            # writes bench/results/data_loader.json

Two workloads on the tiny Qwen2.5-VL tokenizer and image processor:
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
"""

from __future__ import annotations

import io
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from easytrain.config.schema import DataConfig, ModelConfig  # noqa: E402
from easytrain.data.collate import PromptCollator  # noqa: E402
from easytrain.data.dataset import PromptDataset  # noqa: E402
from easytrain.data.loader import PromptLoader  # noqa: E402
from easytrain.data.synthetic import write_parquet  # noqa: E402
from easytrain.models.hf import load_image_processor, load_tokenizer  # noqa: E402
from easytrain.models.tiny import build_tiny  # noqa: E402

BATCH = 16
WORKERS = 2


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


def measure(files: list[str], cfg: DataConfig, tokenizer: Any, processor: Any, cache: str) -> dict[str, float]:
    sampler = RssSampler()
    baseline = sampler.total()
    with sampler:
        start = time.perf_counter()
        dataset = PromptDataset(files, cfg, tokenizer, cache_dir=cache, progress=False)
        scan_s = time.perf_counter() - start
        collator = PromptCollator(tokenizer.pad_token_id, processor, tokenizer.convert_tokens_to_ids("<|image_pad|>"))
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


def main() -> None:
    cache = tempfile.mkdtemp(prefix="easytrain-bench-")
    folder = str(build_tiny("qwen2_5_vl", "tiny", 0, cache))
    tokenizer = load_tokenizer(ModelConfig(path=folder))
    processor = load_image_processor(ModelConfig(path=folder))
    results = []
    sizes = (500, 2000)
    for rows in sizes:
        cfg = DataConfig(synthetic_size=rows, shuffle=True)
        results.append({"workload": "synthetic", **measure(["synthetic:shapes"], cfg, tokenizer, processor, cache)})
        path = Path(cache) / f"photo-{rows}.parquet"
        photo_parquet(path, rows)
        cfg = DataConfig(max_pixels=401408, max_prompt_length=1024)
        results.append({"workload": "photo", **measure([str(path)], cfg, tokenizer, processor, cache)})
        print(json.dumps(results[-2]), json.dumps(results[-1]), sep="\n", flush=True)
    slopes = {}
    for workload in ("synthetic", "photo"):
        small, large = [r for r in results if r["workload"] == workload]
        slopes[workload] = round((large["peak_rss_mb"] - small["peak_rss_mb"]) / ((large["rows"] - small["rows"]) / 1000), 1)

    record = {
        "benchmark": "data_loader",
        "settings": {"batch": BATCH, "num_workers": WORKERS, "model": "tiny:qwen2_5_vl"},
        "results": results,
        "peak_rss_growth_mb_per_1k_samples": slopes,
    }
    out = ROOT / "bench" / "results" / "data_loader.json"
    write_result(out, record)
    print(f"{'workload':<10} {'rows':>5} {'check rows/s':>12} {'samples/s':>10} {'steady/s':>9} {'peak RSS MB':>11}")
    for r in results:
        print(f"{r['workload']:<10} {r['rows']:>5} {r['check_pass_rows_per_s']:>12} "
              f"{r['samples_per_s_incl_worker_start']:>10} {r['samples_per_s_steady']:>9} {r['peak_rss_mb']:>11}")
    for workload, slope in slopes.items():
        print(f"{workload}: peak RSS grows {slope} MB per 1k samples")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
