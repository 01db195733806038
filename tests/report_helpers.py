"""Checks shared by the report and logger tests: PNGs that show something, the images a page shows,
TensorBoard scalars read back, a synthetic run folder."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from PIL import Image

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONFIG_YAML = """trainer:
  task: grpo
  experiment_name: synthetic_grpo
  loggers:
  - console
  - jsonl
  - tensorboard
worker:
  rollout:
    n: 8
"""


def colourful(pixel: tuple[int, ...]) -> bool:
    """Far from grey: a plotted line or area, not text, frame or background."""
    r, g, b = pixel[:3]
    return max(r, g, b) - min(r, g, b) > 60


def png_stats(path: Path) -> dict[str, Any]:
    """Size, distinct colours, share of non-white pixels and count of colourful pixels of a PNG."""
    with Image.open(path) as image:
        assert image.format == "PNG", f"{path}: {image.format}"
        rgb = image.convert("RGB")
        pixels = list(rgb.getdata())
        width, height = rgb.size
    return {"width": width, "height": height, "colours": len(set(pixels)),
            "non_white": sum(p != (255, 255, 255) for p in pixels) / len(pixels),
            "colourful": sum(map(colourful, pixels))}


def assert_nontrivial_png(path: Path) -> dict[str, Any]:
    """A real plot: a valid PNG over 300 x 300 px with many colours, partly drawn on, partly background."""
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    stats = png_stats(path)
    assert stats["width"] > 300 and stats["height"] > 300, (path, stats)
    assert stats["colours"] > 100, (path, stats)  # lines, fills and antialiased text
    assert 0.02 < stats["non_white"] < 0.98, (path, stats)
    assert stats["colourful"] > 500, (path, stats)  # plotted data, not only axes and labels
    return stats


def image_sources(page: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', page)


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the TensorBoard event files under ``logdir``: (step, value) in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: sorted((e.step, e.value) for e in accumulator.Scalars(tag))
            for tag in accumulator.Tags()["scalars"]}


def grpo_records(steps: int = 30, val_every: int = 10) -> list[dict[str, Any]]:
    """What a GRPO run logs: a train record per step, validation at step 0 and every ``val_every`` steps."""
    records: list[dict[str, Any]] = []
    for step in range(steps + 1):
        x = step / steps
        if step > 0:
            reward = 0.1 + 0.7 * x + 0.05 * math.sin(step)
            records.append({
                "step": step, "reward/mean": reward, "reward/std": 0.3 - 0.1 * x, "reward/max": 1.0,
                "reward/min": 0.0, "reward/accuracy": reward * 0.9, "reward/format": 0.5 + 0.4 * x,
                "reward/error_rate": 0.0, "response_length/mean": 20 - 10 * x + 2 * math.cos(step),
                "response_length/max": 32.0, "response_length/min": 3.0 + step % 3,
                "response_length/clip_ratio": 0.2 * (1 - x), "actor/pg_loss": 0.01 * math.sin(step),
                "actor/kl_loss": 0.002 * step, "actor/ppo_kl": 0.0005 * (step % 5), "actor/kl_coef": 0.04,
                "actor/entropy": 2.0 - x, "time/generate": 3.0 + 0.5 * math.sin(step), "time/reward": 0.2,
                "time/old_log_probs": 0.0, "time/advantages": 0.01, "time/update": 4.0 + 0.3 * math.cos(step),
                "time/sync": 0.5, "time/step": 7.71 + 0.5 * math.sin(step) + 0.3 * math.cos(step),
                "perf/generate_tokens_per_s": 300 + 50 * math.sin(step), "memory/node_ram_fraction_max": 0.4 + 0.1 * x})
        if step % val_every == 0:
            records.append({"step": step, "val/reward/mean": 0.05 + 0.8 * x, "val/reward/std": 0.3,
                            "val/reward/max": 1.0, "val/reward/min": 0.0, "val/reward/accuracy": 0.75 * x,
                            "val/reward/error_rate": 0.0, "val/time": 1.5})
    return records


def sft_records(steps: int = 20) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [{"step": 0, "val/loss": 7.0, "val/reward/mean": 0.0, "val/reward/accuracy": 0.0,
                                      "val/time": 1.0}]
    for step in range(1, steps + 1):
        records.append({"step": step, "train/loss": 7.0 * 0.9 ** step, "actor/grad_norm": 5.0 / step,
                        "actor/lr": 1e-3, "time/data": 0.03, "time/forward_backward": 0.2, "time/optimizer": 0.05,
                        "time/step": 0.29, "perf/train_tokens_per_s": 1000.0 + step})
        if step % 5 == 0:
            records.append({"step": step, "val/loss": 7.0 * 0.92 ** step, "val/reward/mean": step / steps,
                            "val/reward/accuracy": step / steps, "val/time": 1.0})
    return records


def write_run(run_dir: Path, records: list[dict[str, Any]], config: str = CONFIG_YAML) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "config.yaml").write_text(config)
    return run_dir
