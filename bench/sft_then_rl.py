"""SFT, then GRPO from the SFT model: the README's pipeline, measured.

    .venv/bin/python bench/sft_then_rl.py       # writes bench/results/sft_then_rl.json (~6 min here)

Three runs of ``python -m easytrain.main`` in fresh processes, each in its
own temporary run folder:

1. ``+exp=tiny_sft``: SFT of the tiny random Qwen2.5-VL on the synthetic
   colour task (3 epochs), exported to ``<sft run>/hf``;
2. the same validation with every image blanked (``data.blank_images=true``,
   ``trainer.val_only=true``) on that model: does it read the images?
3. ``+exp=tiny`` GRPO starting from ``model.path=<sft run>/hf`` (responses of
   up to 4 tokens: the SFT model answers "yellow" as 2 tokens plus the end of
   turn), 2 epochs.

Held-out accuracy is greedy answers to the 64 validation prompts, scored by
the ``answer`` reward; chance is 1/4 (the colours are exactly balanced).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402


def run(name: str, *overrides: str) -> tuple[list[dict[str, Any]], float, str]:
    folder = Path(tempfile.mkdtemp(prefix=f"easytrain-{name}-"))
    command = [sys.executable, "-m", "easytrain.main", *overrides, f"hydra.run.dir={folder}"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{name} failed with exit code {done.returncode}: {' '.join(command)}")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return rows, time.perf_counter() - start, str(folder)


def curve(rows: list[dict[str, Any]], key: str) -> list[list[float]]:
    return [[r["step"], round(r[key], 4)] for r in rows if key in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rl-epochs", type=int, default=2)
    args = parser.parse_args()

    sft, sft_s, sft_dir = run("sft", "+exp=tiny_sft")
    model = f"{sft_dir}/hf"
    blank, blank_s, _ = run("sft-blank", "+exp=tiny_sft", "trainer.val_only=true", f"model.path={model}",
                            "data.blank_images=true", "trainer.export_final=false")
    rl, rl_s, _ = run("grpo-from-sft", f"model.path={model}", "data.max_response_length=4",
                      f"trainer.total_epochs={args.rl_epochs}", "trainer.val_freq=16")
    sft_val, rl_val = curve(sft, "val/reward/mean"), curve(rl, "val/reward/mean")
    record = {
        "benchmark": "sft_then_rl",
        "runs": ["python -m easytrain.main +exp=tiny_sft",
                 "python -m easytrain.main +exp=tiny_sft trainer.val_only=true model.path=<sft>/hf "
                 "data.blank_images=true",
                 f"python -m easytrain.main model.path=<sft>/hf data.max_response_length=4 "
                 f"trainer.total_epochs={args.rl_epochs} trainer.val_freq=16"],
        "chance_accuracy": 0.25,
        "sft": {"wall_s": round(sft_s, 1), "train_loss": curve(sft, "train/loss")[::8] + curve(sft, "train/loss")[-1:],
                "val_loss": curve(sft, "val/loss"), "val_accuracy": sft_val},
        "sft_blank_images": {"wall_s": round(blank_s, 1), "val_accuracy": curve(blank, "val/reward/mean"),
                             "val_loss": curve(blank, "val/loss")},
        "grpo_from_sft": {"wall_s": round(rl_s, 1), "val_accuracy": rl_val,
                          "median_step_s": sorted(r["time/step"] for r in rl if "time/step" in r)[
                              len([r for r in rl if "time/step" in r]) // 2]},
    }
    out = ROOT / "bench" / "results" / "sft_then_rl.json"
    write_result(out, record)
    print(f"SFT ({sft_s:.0f} s): train loss {record['sft']['train_loss'][0][1]} -> {record['sft']['train_loss'][-1][1]}; "
          f"held-out accuracy {' '.join(f'{s}:{a}' for s, a in sft_val)}")
    print(f"SFT model, images blanked: accuracy {record['sft_blank_images']['val_accuracy'][-1][1]} (chance 0.25)")
    print(f"GRPO from the SFT model ({rl_s:.0f} s): held-out accuracy {' '.join(f'{s}:{a}' for s, a in rl_val)}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
