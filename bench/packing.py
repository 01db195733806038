"""Padding waste and rank balance of SFT micro batches: the padded fixed-size layout against padding-free packing.

    .venv/bin/python bench/packing.py                        # -> bench/results/packing.json
    .venv/bin/python bench/packing.py --lengths my.json      # your data: a json list of sample token lengths
                                                             # -> bench/results/packing_my.json

Each of ``--batches`` global batches (``--batch`` samples, seeded) is laid out
over ``--ranks`` data-parallel ranks twice over:

- padded (``worker.actor.padding_free=false``): ``padded_indices``,
  contiguous equal shares per rank, micro batches of ``--micro`` samples,
  each padded to its longest sample (the best case for padding: a micro
  batch cut from a global batch padded to the batch's longest sample, as
  ``Batch.select`` leaves it, costs more);
- packed (``padding_free=true``): ``plan_micro_batches`` with each token
  budget of ``--budgets`` (``worker.actor.max_token_len_per_device``), every
  micro batch flattened into one sequence without padding.

"Processed" tokens are the sequence positions the model runs forward and
backward over: samples x longest sample for a padded micro batch, the sum of
lengths for a packed one. Padding waste = padding positions / processed
tokens (aggregated over all batches). Rank imbalance = max / mean of the
ranks' processed tokens. Step tokens = sum over micro-batch index of the
largest processed micro batch at that index across ranks, what ranks that
synchronise after every micro batch (FSDP, DeepSpeed) wait for; compute is
taken as proportional to tokens (attention's quadratic term is left out).

The synthetic mix is multimodal chat SFT: text tokens log-normal (median
300, sigma 1.0: p99 ~3000), 0-4 images per sample (30/40/15/10/5%), each of a
typical source size (phone photo, screenshot, ..., icon) scaled by a random
factor, resized the Qwen-VL way into [3136, 1003520] pixels (4 .. 1280 image
tokens, + 2 marker tokens), the sample capped at ``--max-len`` tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from easytrain.data.images import smart_resize, vision_tokens  # noqa: E402
from easytrain.data.packing import PlanStats, plan_micro_batches, plan_stats  # noqa: E402
from easytrain.trainer.micro_batches import padded_indices  # noqa: E402

MIN_PIXELS, MAX_PIXELS = 3136, 1003520
IMAGES_PER_SAMPLE = {0: 0.30, 1: 0.40, 2: 0.15, 3: 0.10, 4: 0.05}
# (width, height, weight): typical sources of SFT images
IMAGE_SOURCES = [(4032, 3024, 0.20), (1920, 1080, 0.15), (1280, 720, 0.10), (1024, 768, 0.10), (800, 600, 0.10),
                 (640, 480, 0.15), (512, 512, 0.08), (336, 336, 0.05), (224, 224, 0.05), (64, 64, 0.02)]
GOAL = 0.05


def image_tokens(rng: random.Random) -> int:
    width, height, _ = rng.choices(IMAGE_SOURCES, weights=[w for *_, w in IMAGE_SOURCES])[0]
    scale = math.exp(rng.uniform(math.log(0.5), 0.0))
    h, w = smart_resize(max(1, round(height * scale)), max(1, round(width * scale)), MIN_PIXELS, MAX_PIXELS)
    return vision_tokens(h, w) + 2  # <|vision_start|> ... <|vision_end|>


def synthetic_sample(rng: random.Random, max_len: int) -> int:
    text = max(8, round(rng.lognormvariate(math.log(300), 1.0)))
    images = rng.choices(list(IMAGES_PER_SAMPLE), weights=list(IMAGES_PER_SAMPLE.values()))[0]
    return min(max_len, text + sum(image_tokens(rng) for _ in range(images)))


def batch_source(args: argparse.Namespace) -> tuple[Callable[[random.Random], list[int]], dict[str, Any]]:
    """Draws one global batch of lengths, and a description of where they come from."""
    if args.lengths:
        pool = [int(n) for n in json.loads(Path(args.lengths).read_text())]
        if len(pool) < args.batch:
            raise SystemExit(f"{args.lengths} holds {len(pool)} lengths, fewer than --batch {args.batch}")
        return (lambda rng: rng.sample(pool, args.batch)), {"lengths_file": args.lengths, "pool": len(pool)}
    return (lambda rng: [synthetic_sample(rng, args.max_len) for _ in range(args.batch)]), {
        "mix": "synthetic multimodal chat SFT (see the script's docstring)",
        "text_tokens": "log-normal, median 300, sigma 1.0", "images_per_sample": IMAGES_PER_SAMPLE,
        "image_sources_w_h_weight": IMAGE_SOURCES, "image_scale": "log-uniform in [0.5, 1]",
        "pixels": [MIN_PIXELS, MAX_PIXELS], "max_len": args.max_len}


def summarise(stats: list[PlanStats], refused: int) -> dict[str, Any]:
    if not stats:
        return {"planned_batches": 0, "refused_batches": refused}
    ks = [s.micro_batches_per_rank[0] for s in stats]
    processed = sum(s.processed_tokens for s in stats)
    return {
        "planned_batches": len(stats), "refused_batches": refused,
        "micro_batches_per_rank": {"mean": round(statistics.mean(ks), 2), "min": min(ks), "max": max(ks)},
        "padding_waste": round(sum(s.padded_tokens for s in stats) / processed, 4),
        "processed_tokens_per_batch": round(processed / len(stats)),
        "rank_imbalance": {"mean": round(statistics.mean(s.rank_imbalance for s in stats), 4),
                           "max": round(max(s.rank_imbalance for s in stats), 4)},
        "step_tokens_mean": round(statistics.mean(s.step_tokens for s in stats)),
        "sync_efficiency_mean": round(statistics.mean(s.sync_efficiency for s in stats), 4),
        "largest_micro_batch_max": max(s.largest_micro_batch for s in stats),
    }


def measure(batches: list[list[int]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for micro in args.micro:
        stats = [plan_stats(b, padded_indices(len(b), args.ranks, micro), padded=True) for b in batches]
        results[f"padded, {micro} per device"] = summarise(stats, 0)
    longest = max(max(b) for b in batches)
    for budget in args.budgets:
        name = f"packed, {budget} tokens"
        if budget < longest:
            results[name] = {"skipped": f"a sample of {longest} tokens exceeds the budget of {budget}"}
            continue
        stats, refused = [], 0
        for b in batches:
            try:
                stats.append(plan_stats(b, plan_micro_batches(b, args.ranks, budget), padded=False))
            except ValueError:  # too few samples for equal micro-batch counts: the trainer would refuse too
                refused += 1
        results[name] = summarise(stats, refused)
    return results


def print_table(results: dict[str, dict[str, Any]], baseline: str) -> None:
    base = results[baseline]["step_tokens_mean"]
    print(f"{'layout':<24}{'micro/rank':>12}{'pad waste':>11}{'rank imbal':>16}{'step tokens':>13}"
          f"{'vs ' + baseline.split(', ')[1]:>19}{'sync eff':>10}{'largest micro':>15}")
    for name, r in results.items():
        if "skipped" in r or not r["planned_batches"]:
            print(f"{name:<24}  {r.get('skipped', 'refused in every batch')}")
            continue
        k = r["micro_batches_per_rank"]
        spread = f"{k['mean']:g}" if k["min"] == k["max"] else f"{k['mean']:g} ({k['min']}-{k['max']})"
        imbalance = f"{r['rank_imbalance']['mean']:.3f} ({r['rank_imbalance']['max']:.2f})"
        print(f"{name:<24}{spread:>12}{r['padding_waste']:>10.1%}{imbalance:>16}{r['step_tokens_mean']:>13,}"
              f"{r['step_tokens_mean'] / base:>18.2f}x{r['sync_efficiency_mean']:>10.1%}"
              f"{r['largest_micro_batch_max']:>15,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="samples per global batch")
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks")
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 4], help="padded micro batch sizes per device")
    parser.add_argument("--budgets", type=int, nargs="+", default=[4096, 8192, 16384],
                        help="packed token budgets per device (worker.actor.max_token_len_per_device)")
    parser.add_argument("--batches", type=int, default=50, help="seeded global batches to average over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-len", type=int, default=4096, help="cap on a synthetic sample's tokens")
    parser.add_argument("--lengths", help="a json list of sample token lengths to draw batches from instead")
    parser.add_argument("--out", help="result file (default bench/results/packing.json, or packing_<file>.json)")
    args = parser.parse_args()
    if args.batch % args.ranks:
        parser.error(f"--batch {args.batch} must be a multiple of --ranks {args.ranks} (the padded layout)")

    start = time.perf_counter()
    draw, source = batch_source(args)
    batches = [draw(random.Random(args.seed * 100_003 + i)) for i in range(args.batches)]
    results = measure(batches, args)
    baseline = f"padded, {args.micro[0]} per device"
    packed = [r for name, r in results.items() if name.startswith("packed") and r.get("planned_batches")]
    worst_packed_waste = max((r["padding_waste"] for r in packed), default=None)
    real = [sum(b) for b in batches]
    record = {
        "benchmark": "packing",
        "setting": {"batch": args.batch, "ranks": args.ranks, "micro": args.micro, "budgets": args.budgets,
                    "batches": args.batches, "seed": args.seed, **source},
        "definitions": {
            "processed_tokens": "positions run forward/backward: samples x longest per padded micro batch, "
                                "sum of lengths per packed (flattened) micro batch",
            "padding_waste": "padding positions / processed tokens, summed over all batches",
            "rank_imbalance": "max / mean of the ranks' processed tokens per batch (mean and worst over batches)",
            "step_tokens": "sum over micro-batch index of the largest processed micro batch at that index across "
                           "ranks (what synchronised ranks wait for); mean over batches",
            "sync_efficiency": "processed tokens / (ranks x step tokens)"},
        "lengths": {"real_tokens_per_batch_mean": round(statistics.mean(real)),
                    "sample_median": statistics.median(n for b in batches for n in b),
                    "sample_max": max(max(b) for b in batches),
                    "samples_at_cap": (sum(n >= args.max_len for b in batches for n in b) if not args.lengths
                                       else None)},
        "results": results,
        "goal": f"padding waste <= {GOAL:.0%} with packing",
        "goal_met": worst_packed_waste is not None and worst_packed_waste <= GOAL,
        "seconds": round(time.perf_counter() - start, 2),
    }
    default = f"packing_{Path(args.lengths).stem}.json" if args.lengths else "packing.json"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / default
    write_result(out, record)

    print(f"{args.batches} global batches of {args.batch} samples over {args.ranks} ranks; "
          f"{record['lengths']['real_tokens_per_batch_mean']:,} real tokens per batch (mean), sample median "
          f"{record['lengths']['sample_median']:g}, max {record['lengths']['sample_max']}")
    print("processed = positions run forward/backward (padded: samples x longest per micro batch; packed: sum of "
          "lengths); rank imbalance = max/mean of ranks' processed tokens, mean (worst)")
    print_table(results, baseline)
    print(f"goal {record['goal']}: {'met' if record['goal_met'] else 'NOT met'}; {record['seconds']} s -> {out}")


if __name__ == "__main__":
    main()
