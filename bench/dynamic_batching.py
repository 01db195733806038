"""The RL actor's update with fixed micro batches vs padding-free token-budget ones, on a skewed length mix.

Run:  python bench/dynamic_batching.py [--repeats 5] [--size small]

One actor worker (the real ``ActorWorker``, one rank, fp32, CPU) updates on
the same rollout batch both ways, alternately, ``--repeats`` times:

- fixed: ``worker.actor.micro_batch_size_per_device_for_update`` sequences per
  forward/backward, each padded to the batch's prompt width plus
  ``data.max_response_length`` (the layout the rollout returns);
- dynamic: micro batches the driver plans up to
  ``worker.actor.max_token_len_per_device`` tokens (each of ``--budget``),
  each one flattened sequence without padding.

The batch: the synthetic task's image prompts, ``n`` responses each, response
lengths drawn from a skewed mix (most short, a few up to the maximum), as
RL rollouts often are. Tokens/s counts real (unpadded) tokens only, so both
layouts are measured on the same work. Padding waste = padded positions /
processed positions ("if trimmed": had each fixed micro batch been cut to
its own longest sample, the best any padded layout can do). Rank balance for
8 data-parallel ranks is computed from the plans (no extra run). Writes ``bench/results/dynamic_batching.json``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from easytrain.config import load  # noqa: E402
from easytrain.data.packing import plan_micro_batches, plan_stats  # noqa: E402
from easytrain.trainer.micro_batches import padded_indices  # noqa: E402
from easytrain.distributed.batch import Batch  # noqa: E402
from easytrain.models.tiny import SPECIAL_TOKENS, VOCAB_SIZE  # noqa: E402
from easytrain.trainer.data import RLData  # noqa: E402
from easytrain.trainer.micro_batches import Forward, token_lengths, update_shares  # noqa: E402
from easytrain.workers.actor import ActorWorker  # noqa: E402
from easytrain.workers.sequences import assemble  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "dynamic_batching.json"


def skewed_lengths(count: int, longest: int, generator: torch.Generator) -> list[int]:
    """80% short responses (1 to longest/8 tokens), 20% long ones (longest/2 to longest)."""
    short = torch.randint(1, max(2, longest // 8) + 1, (count,), generator=generator)
    long = torch.randint(longest // 2, longest + 1, (count,), generator=generator)
    is_long = torch.rand(count, generator=generator) < 0.2
    return torch.where(is_long, long, short).tolist()


def rollout_batch(config, seed: int) -> Batch:  # type: ignore[no-untyped-def]
    data = RLData(config)
    prompts = next(data.train_batches())
    n, width = config.worker.rollout.n, config.data.max_response_length
    generator = torch.Generator().manual_seed(seed)
    rows = len(prompts) * n
    lengths = torch.tensor(skewed_lengths(rows, width, generator))
    responses = torch.randint(len(SPECIAL_TOKENS) + 10, VOCAB_SIZE, (rows, width), generator=generator)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    batch = assemble(prompts, Batch({"responses": responses * mask, "response_mask": mask}), n, data.family)
    return batch.union(Batch({"advantages": torch.randn(rows, generator=generator)[:, None] * mask}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="small", choices=["tiny", "small"], help="tiny-model factory size")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4, help="fixed micro batch (sequences per device)")
    parser.add_argument("--budget", type=int, nargs="+", default=[512, 1024, 2048],
                        help="max_token_len_per_device values to measure (tokens)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        common = [f"trainer.output_dir={tmp}", f"model.tiny_size={args.size}", "data.num_workers=0",
                  f"data.synthetic_size={args.prompts}", "data.synthetic_val_size=4", "trainer.workers_per_node=1",
                  f"data.rollout_batch_size={args.prompts}", f"worker.actor.global_batch_size={args.prompts}",
                  f"worker.rollout.n={args.n}", f"data.max_response_length={args.max_response}",
                  f"worker.actor.micro_batch_size_per_device_for_update={args.micro}",
                  "algorithm.use_kl_loss=false"]
        fixed_cfg = load(common)
        batch = rollout_batch(fixed_cfg, seed=0)
        lengths = token_lengths(batch)
        rows, width = batch["attention_mask"].shape
        configs = {"fixed": fixed_cfg}
        plans = {}
        for budget in args.budget:
            configs[f"dynamic-{budget}"] = load([*common, "worker.actor.padding_free=true",
                                                 f"worker.actor.max_token_len_per_device={budget}"])
        workers = {}
        for name, cfg in configs.items():
            workers[name] = ActorWorker(cfg, role="actor", rank=0, world_size=1)
            forward = Forward.of(cfg, workers[name].setup(10 * args.repeats))  # the driver's plan, one rank
            plans[name] = update_shares(batch, len(batch), 1, cfg, forward)

        def runner(name: str):  # type: ignore[no-untyped-def]
            return lambda: workers[name].update(plans[name][0][0], 0.0)

        runs = {name: runner(name) for name in configs}
        for run in runs.values():  # warm-up (allocator, first-call overheads)
            run()
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - start)

    real = sum(lengths)
    fixed_processed = rows * width  # every fixed micro batch holds the batch's full padded width
    fixed_plan = padded_indices(rows, 1, args.micro)
    # 8 data-parallel ranks, from the plans alone: the padded layout priced at its best (each micro batch padded
    # to its own longest sample), the dynamic one with a quarter of the budget (a quarter of the sequences each)
    ranks8 = {"fixed": plan_stats(lengths, padded_indices(rows, 8, args.micro), padded=True),
              "dynamic": plan_stats(lengths, plan_micro_batches(lengths, 8, max(args.budget) // 4), padded=False)}
    layouts = {
        "fixed": {"micro_batch": args.micro, "micro_batches": len(fixed_plan[0]),
                  "median_s": statistics.median(seconds["fixed"]), "runs_s": seconds["fixed"],
                  "tokens_per_s": real / statistics.median(seconds["fixed"]),
                  "padding_waste": 1 - real / fixed_processed,
                  "padding_waste_if_trimmed": plan_stats(lengths, fixed_plan, padded=True).padding_waste},
        **{name: {"max_token_len_per_device": int(name.split("-")[1]), "micro_batches": len(plans[name][1][0][0]),
                  "median_s": statistics.median(seconds[name]), "runs_s": seconds[name],
                  "tokens_per_s": real / statistics.median(seconds[name]),
                  "padding_waste": plan_stats(lengths, plans[name][1][0], padded=False).padding_waste}
           for name in plans},
    }
    result = {
        "model": f"tiny-model factory qwen2_5_vl '{args.size}'", "device": "CPU, fp32, one rank",
        "batch": {"sequences": rows, "real_tokens": real, "padded_width": width,
                  "response_lengths": batch["response_mask"].sum(-1).tolist(),
                  "length_mix": "80% 1..max/8, 20% max/2..max response tokens"},
        "layouts": layouts,
        "speedup_vs_fixed": {name: layouts[name]["tokens_per_s"] / layouts["fixed"]["tokens_per_s"] for name in plans},
        "eight_ranks_plan": {name: {"padding_waste": s.padding_waste, "rank_imbalance": s.rank_imbalance,
                                    "sync_efficiency": s.sync_efficiency}
                             for name, s in ranks8.items()},
    }
    write_result(RESULTS, result)
    print(f"{rows} sequences, {real} real tokens, padded width {width}")
    for name in configs:
        r = layouts[name]
        print(f"{name:13s} {r['micro_batches']:3d} micro batches  median {r['median_s']:.2f} s  "
              f"{r['tokens_per_s']:.0f} tokens/s  padding waste {r['padding_waste']:.1%}")
    print(f"fixed, had each micro batch been trimmed to its longest sample: padding waste "
          f"{layouts['fixed']['padding_waste_if_trimmed']:.1%}")
    for name, ratio in result["speedup_vs_fixed"].items():
        print(f"{name} / fixed tokens/s: {ratio:.2f}x")
    print("goal: padding waste <= 5%")
    for name, s in ranks8.items():
        print(f"8 ranks (plan only), {name}: padding waste {s.padding_waste:.1%}, rank imbalance {s.rank_imbalance:.3f}")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
