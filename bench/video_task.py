"""The built-in video task learned by the tiny model: ``+exp=tiny_video``, measured.

    .venv/bin/python bench/video_task.py              # writes bench/results/video_task.json (~8 min here)
    .venv/bin/python bench/video_task.py --seeds 1    # one seed

For each seed, three runs of ``python -m easytrain.main`` in fresh processes:

1. ``+exp=tiny_video trainer.seed=S``: SFT of the tiny random Qwen2.5-VL on
   ``synthetic:shapes/motion`` ("Which way does the pattern move: left or
   right?", 4 frames; chance 1/2), exported to ``<run>/hf``;
2. validation only, on that model, of the same held-out clips with their
   frames in reverse order (written beside the run): a model that reads the
   frames' order gives the opposite answers;
3. validation only with every frame blanked (``data.blank_images=true``):
   back to chance.

Held-out accuracy is greedy answers to the 64 validation clips, scored by the
``answer`` reward.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from bench.sft_then_rl import curve, run  # noqa: E402


def reversed_clips(seed: int, folder: Path) -> Path:
    """The validation split of the motion task for ``seed`` with every clip's frames reversed."""
    import pyarrow.parquet as pq

    from easytrain.config import load
    from easytrain.data.synthetic import ensure_synthetic, write_parquet

    d = load(["+exp=tiny_video", f"trainer.seed={seed}"]).data
    val = ensure_synthetic("shapes/motion", "val", d.synthetic_val_size, seed, d.synthetic_difficulty)
    out = folder / "reversed.parquet"
    write_parquet([{**r, "videos": [frames[::-1] for frames in r["videos"]]} for r in pq.read_table(val).to_pylist()],
                  out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for seed in range(1, args.seeds + 1):
        sft, sft_s, folder = run(f"video-{seed}", "+exp=tiny_video", f"trainer.seed={seed}",
                                 "trainer.export_final=true")
        model = f"{folder}/hf"
        flipped_file = reversed_clips(seed, Path(tempfile.mkdtemp(prefix="easytrain-video-reversed-")))
        flipped, _, _ = run(f"video-{seed}-reversed", "+exp=tiny_video", f"trainer.seed={seed}",
                            "trainer.val_only=true", f"model.path={model}", f"data.val_files={flipped_file}")
        blank, _, _ = run(f"video-{seed}-blank", "+exp=tiny_video", f"trainer.seed={seed}", "trainer.val_only=true",
                          f"model.path={model}", "data.blank_images=true")
        record = {"seed": seed, "wall_s": round(sft_s, 1), "val_accuracy": curve(sft, "val/reward/mean"),
                  "train_loss": curve(sft, "train/loss")[::16] + curve(sft, "train/loss")[-1:],
                  "reversed_frames_accuracy": curve(flipped, "val/reward/mean")[-1][1],
                  "blank_frames_accuracy": curve(blank, "val/reward/mean")[-1][1]}
        runs.append(record)
        print(f"seed {seed} ({sft_s:.0f} s): held-out accuracy "
              f"{' '.join(f'{s}:{a}' for s, a in record['val_accuracy'])}; frames reversed "
              f"{record['reversed_frames_accuracy']}, blanked {record['blank_frames_accuracy']} (chance 0.5)")
    out = ROOT / "bench" / "results" / "video_task.json"
    write_result(out, {
        "benchmark": "video_task",
        "runs_per_seed": ["python -m easytrain.main +exp=tiny_video trainer.seed=S trainer.export_final=true",
                          "... trainer.val_only=true model.path=<run>/hf data.val_files=<val clips, frames reversed>",
                          "... trainer.val_only=true model.path=<run>/hf data.blank_images=true"],
        "chance_accuracy": 0.5, "runs": runs,
        "min_final_val_accuracy": min(r["val_accuracy"][-1][1] for r in runs),
    })
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
