"""bench/gpu_step.py's wiring, on CPU (issue 32): its figures exist only where a GPU measured them, so here it
writes no results file, and its easytrain side runs the real trainer with the bench's settings on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_step.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the bench measures (minutes), not refuses")
def test_without_a_gpu_it_writes_nothing_and_says_why() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert "measures on a CUDA device and this machine has none: nothing written" in done.stderr
    assert not (ROOT / "bench" / "results" / "gpu_step.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["image_heavy"])  # (the small shape: the same code, fewer image tokens)
def test_the_easytrain_side_runs_the_bench_settings(tiny_model, tmp_path: Path, shape: str) -> None:
    out = tmp_path / "side.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--side", "easytrain", "--shape", shape, "--model",
                           str(tiny_model("qwen2_5_vl")), "--device", "cpu", "--steps", "1", "--warmup", "0",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["median_step_s"] > 0 and len(summary["steps"]) == 1
    assert {"generate", "update", "sync"} <= set(summary["median_phase_s"])
    prompts, n, pixels = {"small": (8, 4, 56 * 56), "image_heavy": (4, 8, 448 * 448)}[shape]
    # the update ran over every sequence's prompt (its image tokens included) and response
    assert summary["median_update_tokens"] > prompts * n * pixels // (28 * 28)
    assert summary["median_sync_s"] > 0 and summary["host_peak_rss_gb"] > 0
