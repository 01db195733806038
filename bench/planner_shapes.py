"""Run shapes drawn at random for bench/planner_accuracy.py (issue 47): held out by construction.

A seed draws a set of runs (model size, images per prompt and their side, prompt and response lengths, n, batch
and micro-batch sizes, padded or padding-free, prompt sharing, workers per node, fused or split pools, LoRA,
offload, a KL term, reward workers; RL or SFT) that no planner constant was read from. Accuracy is quoted on such a set only;
when a miss on it leads to a fix, the next quote draws with a fresh seed. Every drawn run's config passes
easytrain's validation and its worker pools fit the bench machine's CPUs (else it is drawn again); every shape
the generator draws fits its 24 GB of RAM (the largest, the ~184M model in split pools, needs ~10 GB).

Data: the synthetic shapes task sized to exactly ``side`` x ``side`` pixels (``data.min_pixels`` =
``data.max_pixels``), one image per prompt, or ``k`` of them in a parquet of ``k`` synthetic images per row
(:func:`multi_image_files`, written once into the easytrain cache). ``data.max_prompt_length`` is the prompt's
tokens with a little room, so the data fills the bound the plan prices.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from bench.planner_model import BENCH_MODEL

IMAGES = "{bench_images_%d_%s}"
"""Placeholder for the parquet of ``k`` images per row of a split, replaced when a run is built."""
MODELS = {"tiny": ["model.path=tiny:qwen2_5_vl"], "small": ["model.path=tiny:qwen2_5_vl", "model.tiny_size=small"],
          "mid": [f"model.path={BENCH_MODEL}"]}
PROMPT_TEXT_TOKENS = 64
"""The synthetic question with its chat template, and room: a prompt's tokens besides its image tokens."""
BENCH_CPUS = 2
"""The CPUs of the machine the bench is defined for: a drawn run whose worker pools need more (``workers_per_node``
per pool) is drawn again. The draw never asks the planner, so a planner change cannot change a seed's set."""


@dataclass(frozen=True)
class Case:
    name: str
    tag: str
    overrides: list[str]


def _rl(rng: random.Random) -> list[str]:
    prompts, n = rng.choice([2, 4, 8]), rng.choice([2, 4, 8])
    per_step = rng.choice([p for p in (1, 2, prompts) if prompts % p == 0])
    sequences = per_step * n
    return [f"data.rollout_batch_size={prompts}", f"worker.rollout.n={n}",
            f"worker.actor.global_batch_size={per_step}",
            f"worker.actor.micro_batch_size_per_device_for_update={rng.choice([1, 2, 4, sequences])}",
            f"worker.actor.micro_batch_size_per_device_for_experience={rng.choice([1, 2, 4, 8])}",
            f"data.max_response_length={rng.choice([4, 8, 16, 32])}", f"algorithm.kl_coef={rng.choice([0, 0.01])}",
            f"worker.actor.share_prompt={rng.choice(['true', 'false'])}",
            f"trainer.colocate={'false' if rng.random() < 0.2 else 'true'}",
            f"reward.num_workers={rng.choice([1, 2, 4])}"]


def _sft(rng: random.Random) -> list[str]:
    return ["+exp=tiny_sft", f"worker.actor.global_batch_size={rng.choice([4, 8, 16])}",
            f"worker.actor.micro_batch_size_per_device_for_update={rng.choice([1, 2, 4])}"]


def _images(rng: random.Random) -> list[str]:
    k, side = rng.choice([1, 1, 2, 3]), rng.choice([56, 112, 224, 448])
    tokens = k * (side // 28) ** 2
    out = [f"data.min_pixels={side * side}", f"data.max_pixels={side * side}",
           f"data.max_prompt_length={PROMPT_TEXT_TOKENS + tokens}"]
    if k > 1:
        out += [f"data.train_files={IMAGES % (k, 'train')}", f"data.val_files={IMAGES % (k, 'val')}",
                f"data.limit_images={k}"]
    return out


def _one(rng: random.Random, name: str, tag: str) -> Case:
    sft = rng.random() < 0.3
    model = rng.choices(list(MODELS), weights=[4, 4, 1])[0]
    overrides = [*(_sft(rng) if sft else _rl(rng)), *MODELS[model], *_images(rng),
                 f"trainer.workers_per_node={rng.choice([1, 2])}",
                 f"worker.actor.padding_free={rng.choice(['true', 'false'])}"]
    if rng.random() < 0.3:
        overrides.append(f"model.lora.rank={rng.choice([8, 16])}")
    if rng.random() < 0.2:
        overrides.append("worker.actor.offload.params=true")
    return Case(name, tag, overrides)


def draw(seed: int, count: int, tag: str, fits: Any) -> list[Case]:
    """``count`` valid runs drawn with ``seed``; ``fits(case)`` says whether a drawn run is kept (its config
    validates and its pools fit the bench machine's CPUs: :func:`bench.planner_accuracy.runnable`)."""
    rng = random.Random(f"planner-shapes/{seed}")
    cases: list[Case] = []
    tries = 0
    while len(cases) < count:
        tries += 1
        if tries > 50 * count:
            raise RuntimeError(f"seed {seed}: only {len(cases)} of {count} drawn runs are valid and fit")
        case = _one(rng, f"{tag}_s{seed}_{len(cases):02d}", tag)
        if fits(case):
            cases.append(case)
    return cases


def multi_image_files(k: int, cache: Optional[Path] = None) -> dict[str, Path]:
    """Train and validation parquets of the synthetic shapes task with ``k`` images per row: each row joins the
    images of ``k`` rows and asks the last one's question (written once)."""
    from easytrain.data.synthetic import generate, write_parquet
    from easytrain.models.tiny import default_cache_dir

    folder = (cache or default_cache_dir()) / "bench_images"
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, size in (("train", 128), ("val", 16)):
        path = folder / f"images_{k}_{split}.parquet"
        if not path.is_file():
            rows = [r for r in generate(size * k, seed=0, split=split, difficulty=1) if r["images"]]
            joined = []
            for i in range(0, len(rows) - k + 1, k):
                group = rows[i:i + k]
                question = group[-1]["problem"].removeprefix("<image>")
                joined.append({**group[-1], "images": [im for r in group for im in r["images"]],
                               "problem": "<image>" * k + question, "messages": None, "conversation_images": None})
            write_parquet([{key: r[key] for key in ("images", "videos", "problem", "answer", "question_type")}
                           for r in joined], path)
        out[split] = path
    return out


def placeholders(overrides: list[str], model_folder: Path) -> list[str]:
    """``overrides`` with the bench model's folder and the image parquets' paths in place of their
    placeholders (the parquets written when first needed)."""
    out = []
    for o in overrides:
        o = o.replace(BENCH_MODEL, str(model_folder))
        for k in (2, 3, 4):
            for split in ("train", "val"):
                if IMAGES % (k, split) in o:
                    o = o.replace(IMAGES % (k, split), str(multi_image_files(k)[split]))
        out.append(o)
    return out
