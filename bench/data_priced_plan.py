"""The plan priced on the data against whole runs on data with a known distribution (issue 50).

    .venv/bin/python bench/data_priced_plan.py              # every case (~15 min here) -> bench/results/data_priced_plan.json
    .venv/bin/python bench/data_priced_plan.py --only NAME  # (re)run one case, keep the others' from the file
    .venv/bin/python bench/data_priced_plan.py --rescore    # predictions only, measurements from the file

Each case writes a parquet whose images are drawn with a fixed seed (:func:`draw_sizes`): most rows one small
image (sides 56-196 px, 4-49 vision tokens), a few rows a large one (the outliers, 150-200 tokens), under a
``data.max_pixels`` and ``data.max_prompt_length`` far above them (1280 vision tokens): a config written for
larger images than the data has, as users write them (EasyR1's geometry3k recipe allows 4M pixels for diagrams
of a few hundred pixels a side). The train split holds two steps of prompts, so the run reads every row,
outliers included, in its first two steps (and again from the third, after a resume).

The runs are measured as bench/planner_accuracy.py measures its cases (the same code: a 2-step run, its resume
to a third step and an export; every phase's host bytes per node, the workers' exact peaks plus the other
processes' sampled ones). Each phase's figure is set beside two plans of the same config: ``data`` (the plan
priced on the data profile the launch check reads: ``easytrain.trainer.data.profile_data``, then
``plan(config, data=...)``) and ``bound`` (every row at the limits, as before issue 50). The goal: every
phase's ``data`` figure within 10% of the measurement and never more than 5% below it, the ``bound`` figure
above it. These cases were never used to fit a constant of the planner: they are held-out runs for it (its
host constants were fitted on runs whose data fill their limits, bench/planner_accuracy.py's calibration set).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.planner_accuracy import BASE, GB, LOW, RUNS, SAMPLING, WITHIN, _error, measure_case, planned_rows  # noqa: E402
from bench.planner_model import BENCH_MODEL, bench_model_folder  # noqa: E402
from bench.planner_shapes import Case, placeholders  # noqa: E402
from bench.provenance import measured_provenance, write_rescored, write_result  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "data_priced_plan.json"
DATA_SEED = 2
"""The image sizes' seed. Seed 0 was the first draw: the 184M model's update missed (+17.0%, priced on the
validation split's longer rows), which led to pricing a step on the train rows alone. Seed 1, drawn after that
fix, met the goal per node (25 of 25) but not per worker process (23 of 25, two updates at +10.3% and +10.9%);
the step batch's pixels were priced on its costliest prompts and each rank's share on its own costliest ones
after those results were seen, so the quote moved to seed 2, drawn after every change."""
SMALL_SIDES = range(56, 197, 28)
"""Sides (px) of the ordinary images, drawn uniformly: on Qwen2.5-VL's 28-px grid 2-7 blocks a side."""
LARGE_SIDES = range(336, 421, 28)
"""Sides of the outliers' images: 12-15 blocks a side, 144-225 vision tokens."""
LIMITS = ["data.max_pixels=1003520", "data.max_prompt_length=1344", "data.min_pixels=3136"]
"""1280 vision tokens an image (1003520 = 1280 x 28 x 28) and room for the question: the limits the bound plan
fills, far above every image of the data."""
SHAPE = ["data.rollout_batch_size=4", "worker.actor.global_batch_size=4", "data.max_response_length=32"]
TRAIN_ROWS, VAL_ROWS = 8, 4
"""Two steps of 4 prompts: the run's first two steps read every train row."""


def draw_sizes(rng: random.Random, rows: int, outliers: int, images: int) -> list[list[tuple[int, int]]]:
    """Per row ``images`` (width, height) sizes: small ones, and one large image in ``outliers`` rows."""
    large = set(rng.sample(range(rows), outliers))
    out = []
    for row in range(rows):
        sizes = [(rng.choice(SMALL_SIDES), rng.choice(SMALL_SIDES)) for _ in range(images)]
        if row in large:
            sizes[0] = (rng.choice(LARGE_SIDES), rng.choice(LARGE_SIDES))
        out.append(sizes)
    return out


def write_split(path: Path, sizes: list[list[tuple[int, int]]], seed: int) -> None:
    """A parquet in the prompt/answer schema: per row its images (PNG, one flat colour), a question, its answer."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    colours = {"red": (200, 20, 20), "green": (20, 180, 40), "blue": (30, 40, 210)}
    rng = random.Random(seed)
    rows = []
    for row_sizes in sizes:
        name = rng.choice(sorted(colours))
        images = []
        for size in row_sizes:
            buffer = io.BytesIO()
            Image.new("RGB", size, colours[name]).save(buffer, format="PNG")
            images.append({"bytes": buffer.getvalue(), "path": None})
        rows.append({"images": images, "problem": "<image>" * len(row_sizes) + "What colour is the first image?",
                     "answer": name})
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("images", pa.list_(image)), ("problem", pa.string()), ("answer", pa.string())])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def data_of(name: str, images: int, seed: int) -> tuple[list[str], dict[str, Any]]:
    """The case's parquets (written under RUNS) and what was drawn for them."""
    rng = random.Random(f"{name}:{seed}")
    drawn = {}
    overrides = []
    for split, rows, outliers in (("train", TRAIN_ROWS, 2), ("val", VAL_ROWS, 1)):
        sizes = draw_sizes(rng, rows, outliers, images)
        path = RUNS / "data" / f"{name}_{seed}_{split}.parquet"
        write_split(path, sizes, seed)
        overrides.append(f"data.{split}_files={path}")
        drawn[split] = [[list(s) for s in row] for row in sizes]
    return overrides, drawn


SETTINGS = {
    "mid_padded": [f"model.path={BENCH_MODEL}", "worker.rollout.n=2",
                   "worker.actor.micro_batch_size_per_device_for_update=2",
                   "worker.actor.micro_batch_size_per_device_for_experience=2"],
    "small_packed": ["model.path=tiny:qwen2_5_vl", "model.tiny_size=small", "worker.rollout.n=4",
                     "worker.actor.padding_free=true", "algorithm.kl_coef=0.01"],
    "tiny_two_images": ["model.path=tiny:qwen2_5_vl", "worker.rollout.n=4", "data.limit_images=2",
                        "worker.actor.micro_batch_size_per_device_for_update=4"],
}
"""The cases: the ~184M bench model with padded micro batches of two (the longest rows together), the small
tiny model padding-free with a reference, and the tiny model with two images a row."""
IMAGES = {"tiny_two_images": 2}


def cases(seed: int) -> tuple[list[Case], dict[str, Any]]:
    out, drawn = [], {}
    for name, settings in SETTINGS.items():
        files, drawn[name] = data_of(name, IMAGES.get(name, 1), seed)
        out.append(Case(name, "held_out", LIMITS + SHAPE + settings + files))
    return out, drawn


def score(rows: list[dict[str, Any]], folder: Path) -> None:
    for row in rows:
        overrides = placeholders(row["overrides"], folder)
        on_data, bound = planned_rows(overrides, priced_on_data=True), planned_rows(overrides)
        for phase, figure in row["phases"].items():
            figure["predicted_bytes"] = on_data.get(phase, {}).get("host")
            figure["error"] = _error(figure["predicted_bytes"], figure["host_bytes"])
            figure["predicted_process_bytes"] = on_data.get(phase, {}).get("process_host")
            figure["process_error"] = _error(figure["predicted_process_bytes"], max(figure.get("worker_peaks") or [0]))
            figure["bound_bytes"] = bound.get(phase, {}).get("host")
            figure["bound_error"] = _error(figure["bound_bytes"], figure["host_bytes"])


def accuracy(figures: list[tuple[str, dict[str, Any]]], key: str) -> dict[str, Any]:
    errors = [(name, f[key]) for name, f in figures if f.get(key) is not None]
    ok = lambda e: -LOW <= e <= WITHIN  # noqa: E731
    return {"met": bool(errors) and len(errors) == len(figures) and all(ok(e) for _, e in errors),
            "within": f"{sum(ok(e) for _, e in errors)} of {len(figures)}",
            "worst_under_prediction": min(e for _, e in errors) if errors else None,
            "worst_over_prediction": max(e for _, e in errors) if errors else None,
            "misses": {name: round(e, 4) for name, e in errors if not ok(e)}}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The goal per node (every process of the run), and for the busiest worker process (what the in-run plan
    check compares), beside how far the bound plan overstates: every case is held out (never fitted on)."""
    figures = [(f"{r['name']}:{p}", f) for r in rows for p, f in r["phases"].items()]
    bound_over = [name for name, f in figures if f["bound_error"] is not None and f["bound_error"] > WITHIN]
    return {"goal": {"text": f"every phase's data-priced plan within {WITHIN:.0%} of measured and never more than "
                             f"{LOW:.0%} low", "held_out": accuracy(figures, "error")},
            "per_process": {"held_out": accuracy(figures, "process_error")},
            "bound": {"held_out": {"phases_overstated_past_10_percent": f"{len(bound_over)} of {len(figures)}",
                                   "worst_over_prediction": max((f["bound_error"] for _, f in figures
                                                                 if f["bound_error"] is not None), default=None)}}}


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'case':16} {'phase':15} {'measured':>9} {'data':>9} {'error':>7} {'bound':>9} {'error':>7} "
            f"{'process':>8}")
    lines = ["GB (1e9 bytes) per node; data = the plan priced on the data profile, bound = every row at the limits, "
             "process = the data plan's busiest worker against the largest worker peak",
             head, "-" * len(head)]
    fmt = lambda v: f"{v / GB:9.3f}" if v is not None else "        -"  # noqa: E731
    pct = lambda e: f"{100 * e:+6.1f}%" if e is not None else "      -"  # noqa: E731
    for r in rows:
        for phase, f in r["phases"].items():
            lines.append(f"{r['name']:16} {phase:15} {f['host_bytes'] / GB:9.3f} {fmt(f['predicted_bytes'])} "
                         f"{pct(f['error'])} {fmt(f['bound_bytes'])} {pct(f['bound_error'])} "
                         f"{pct(f.get('process_error'))}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], help="case name (repeatable)")
    parser.add_argument("--rescore", action="store_true", help="re-predict only; measurements from the results file")
    parser.add_argument("--data-seed", type=int, default=DATA_SEED, help="the seed of the cases' image sizes")
    args = parser.parse_args()
    start = time.perf_counter()
    every, drawn = cases(args.data_seed)
    unknown = set(args.only) - {c.name for c in every}
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; cases: {', '.join(c.name for c in every)}")
    folder = bench_model_folder()
    old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if old.get("data_seed", args.data_seed) != args.data_seed and (args.rescore or args.only):
        parser.error(f"{RESULTS} holds data seed {old['data_seed']}'s runs: measure every case for a new seed")
    kept = {r["name"]: r for r in old.get("rows", [])}
    for case in every:
        if args.rescore or (args.only and case.name not in args.only):
            continue
        print(f"measuring {case.name} ...", flush=True)
        kept[case.name] = measure_case(case, folder)
    rows = [kept[c.name] for c in every if c.name in kept and kept[c.name]["overrides"] == BASE + c.overrides]
    score(rows, folder)
    print(table(rows))
    result = {"data_seed": args.data_seed, "images_drawn": drawn, "sampling": SAMPLING, **summary(rows),
              "rows": rows, "wall_s": time.perf_counter() - start if not args.rescore else old.get("wall_s")}
    if args.rescore:
        write_rescored(RESULTS, result, measured_provenance(old), indent=1)
    else:
        write_result(RESULTS, result, indent=1)
    g = result["goal"]["held_out"]
    print(f"per process: {result['per_process']['held_out']['within']} phases within the band")
    print(f"goal ({result['goal']['text']}): {'met' if g['met'] else 'not met'} ({g['within']}); bound plan "
          f"overstates {result['bound']['held_out']['phases_overstated_past_10_percent']} phases past 10% -> "
          f"{RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
