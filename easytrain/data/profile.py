"""What a dataset's rows will cost, read before launch by the training rules: per row its images as decoded, the
vision and prompt tokens after the resize rules and the chat template; the distribution (p50, p90, p99, max), the
costliest rows by name, and what other limits (``data.max_pixels``, ``data.max_prompt_length``,
``data.limit_images``) would keep.

Large data is sampled: at most ``data.profile_rows`` rows per split, drawn uniformly without replacement (seeded)
and read in file order, so a parquet file is read one row group at a time. A row the run would skip is counted by
the reason the run's ``data_report.json`` gives it; the whole split read gives the same counts.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from tqdm import tqdm

from easytrain.data.images import BadSample, smart_resize
from easytrain.data.vision import Layout

PERCENTILES = (50, 90, 99)
COSTLIEST = 10
"""Rows named as the costliest."""
UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class RowCost:
    """One usable row as training will see it."""

    where: str
    """``<file>#<row>``."""
    sizes: tuple[tuple[int, int], ...]
    """Each image's (height, width) as decoded."""
    image_tokens: tuple[int, ...]
    """Each image's vision tokens after the resize rules."""
    video_tokens: int
    prompt_tokens: int
    """The rendered prompt, vision tokens included."""
    pixels: int
    """Pixels after the resize rules: the images and every video frame."""
    downscaled: bool = False

    @property
    def vision_tokens(self) -> int:
        return sum(self.image_tokens) + self.video_tokens

    @property
    def text_tokens(self) -> int:
        """The prompt's tokens besides the vision tokens (the template's, and an image's open and close marks)."""
        return self.prompt_tokens - self.vision_tokens

    def as_dict(self) -> dict[str, Any]:
        return {"row": self.where, "images": len(self.sizes), "image_sizes": [list(s) for s in self.sizes],
                "pixels": self.pixels, "vision_tokens": self.vision_tokens, "prompt_tokens": self.prompt_tokens,
                "downscaled": self.downscaled}


def row_cost(prompt: Any) -> RowCost:
    """The cost of a built :class:`easytrain.data.dataset.Prompt`."""
    image_pixels = sum(im.width * im.height for im in prompt.images)
    video_pixels = sum(f.width * f.height for clip in prompt.videos for f in clip.frames)
    return RowCost(where=prompt.uid, sizes=tuple(tuple(s) for s in prompt.sizes),
                   image_tokens=tuple(prompt.image_tokens), video_tokens=prompt.video_tokens,
                   prompt_tokens=len(prompt.input_ids), pixels=image_pixels + video_pixels,
                   downscaled=prompt.downscaled)


def sample_positions(lengths: Sequence[int], rows: int, seed: int) -> list[tuple[int, int]]:
    """Every (source, row) position when there are at most ``rows``; else ``rows`` of them drawn uniformly
    without replacement (``seed``), in file order."""
    total = sum(lengths)
    picks = range(total) if total <= rows else sorted(random.Random(seed).sample(range(total), rows))
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    out, s = [], 0
    for i in picks:
        while i >= starts[s + 1]:
            s += 1
        out.append((s, i - starts[s]))
    return out


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99 (nearest rank) and max of ``values``; zeros for none."""
    ordered = sorted(values)
    if not ordered:
        return {**{f"p{q}": 0 for q in PERCENTILES}, "max": 0}
    rank = {f"p{q}": ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] for q in PERCENTILES}
    return {**rank, "max": ordered[-1]}


@dataclass(frozen=True)
class Rules:
    """The limits a profile was read under, and the family's grid (to re-price images under other limits)."""

    min_pixels: int
    max_pixels: int
    max_prompt_length: int
    limit_images: int
    layout: Layout


@dataclass
class DataProfile:
    """The costs of a split's sampled rows and the counts of those the run would skip."""

    split: str
    rows: int
    """Rows in the split."""
    rules: Rules
    costs: list[RowCost] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    """Sampled rows the run would skip, by reason (``data_report.json``'s)."""
    over: dict[str, list[int]] = field(default_factory=dict)
    """For rows skipped at a limit, what they measured (``prompt_too_long``: tokens; ``too_many_images``: images)."""

    @property
    def sampled(self) -> int:
        return len(self.costs) + sum(self.skipped.values())

    def stats(self) -> dict[str, dict[str, float]]:
        """The distribution of the kept rows' vision tokens, prompt tokens, images and pixels."""
        columns: dict[str, Callable[[RowCost], float]] = {
            "vision_tokens": lambda c: c.vision_tokens, "prompt_tokens": lambda c: c.prompt_tokens,
            "images": lambda c: len(c.sizes), "pixels": lambda c: c.pixels}
        return {name: percentiles([get(c) for c in self.costs]) for name, get in columns.items()}

    def costliest(self, count: int = COSTLIEST) -> list[RowCost]:
        """The rows with the most prompt tokens (then pixels)."""
        return sorted(self.costs, key=lambda c: (c.prompt_tokens, c.pixels), reverse=True)[:count]

    def image_tokens_under(self, max_pixels: int) -> Iterator[tuple[RowCost, int, bool]]:
        """Each kept row's vision tokens of its images with ``data.max_pixels=max_pixels``, and whether every
        image of it keeps its full size (the limit does not shrink it)."""
        r = self.rules
        for cost in self.costs:
            tokens, whole = 0, True
            for height, width in cost.sizes:
                sized = _sized(height, width, r, max_pixels)
                tokens += r.layout.image_tokens(*sized)
                whole = whole and sized == _sized(height, width, r, UNBOUNDED)
            yield cost, tokens, whole

    def pixel_candidates(self, values: Sequence[int]) -> list[dict[str, Any]]:
        """For each ``data.max_pixels`` value: the share of rows whose images keep their full size, the rows' vision
        tokens (p99, max), their prompt tokens (max) and the rows that would pass ``data.max_prompt_length``. Rows
        downscaled to fit today are priced at their full images' tokens (an upper bound)."""
        out = []
        kept = max(1, len(self.costs))
        for value in sorted(set(values)):
            vision, prompts, whole_rows, fitting = [], [], 0, 0
            for cost, tokens, whole in self.image_tokens_under(value):
                total = cost.prompt_tokens - sum(cost.image_tokens) + tokens
                vision.append(tokens + cost.video_tokens)
                prompts.append(total)
                whole_rows += whole
                fitting += total <= self.rules.max_prompt_length
            spread = percentiles(vision)
            out.append({"max_pixels": value, "unscaled_share": whole_rows / kept, "vision_tokens_p99": spread["p99"],
                        "vision_tokens_max": spread["max"], "prompt_tokens_max": max(prompts, default=0),
                        "within_max_prompt_length_share": fitting / kept})
        return out

    def length_candidates(self, values: Sequence[int]) -> list[dict[str, Any]]:
        """For each ``data.max_prompt_length`` value: the share of the sampled rows (kept or skipped for length)
        whose prompt fits."""
        lengths = [c.prompt_tokens for c in self.costs] + self.over.get("prompt_too_long", [])
        total = max(1, len(lengths))
        return [{"max_prompt_length": v, "kept_share": sum(n <= v for n in lengths) / total}
                for v in sorted(set(values))]

    def image_count_candidates(self, values: Sequence[int]) -> list[dict[str, Any]]:
        """For each ``data.limit_images`` value: the share of the sampled rows (kept or skipped for their image
        count) it admits."""
        counts = [len(c.sizes) for c in self.costs] + self.over.get("too_many_images", [])
        total = max(1, len(counts))
        return [{"limit_images": v, "kept_share": sum(n <= v for n in counts) / total} for v in sorted(set(values))]

    def as_dict(self) -> dict[str, Any]:
        r = self.rules
        return {"split": self.split, "rows": self.rows, "sampled": self.sampled, "kept": len(self.costs),
                "skipped": dict(sorted(self.skipped.items())), "stats": self.stats(),
                "costliest": [c.as_dict() for c in self.costliest()],
                "max_pixels": self.pixel_candidates(pixel_values(self)),
                "max_prompt_length": self.length_candidates(length_values(self)),
                "limit_images": self.image_count_candidates(range(1, max(2, r.limit_images + 2)))}


def _sized(height: int, width: int, rules: Rules, max_pixels: int) -> tuple[int, int]:
    if rules.layout.fixed_size:
        return rules.layout.factor, rules.layout.factor
    return smart_resize(height, width, min(rules.min_pixels, max_pixels), max_pixels, rules.layout.factor)


def pixel_values(profile: DataProfile) -> list[int]:
    """``data.max_pixels`` values worth comparing: the configured one, a quarter, half, twice and four times it,
    and the grid-rounded pixels of the data's images at p50, p90, p99 and max."""
    r = profile.rules
    cell = r.layout.factor * r.layout.factor
    sizes = [h * w for c in profile.costs for h, w in c.sizes]
    spread = percentiles(sizes) if sizes else {}
    data = [max(cell, round(v / cell) * cell) for v in spread.values()]
    return [v for v in {r.max_pixels // 4, r.max_pixels // 2, r.max_pixels, 2 * r.max_pixels, 4 * r.max_pixels,
                        *data} if v >= max(cell, r.min_pixels)]


def length_values(profile: DataProfile) -> list[int]:
    """``data.max_prompt_length`` values worth comparing: the configured one and the data's p90, p99 and max."""
    lengths = [c.prompt_tokens for c in profile.costs] + profile.over.get("prompt_too_long", [])
    spread = percentiles(lengths)
    return [profile.rules.max_prompt_length, *(int(spread[k]) for k in ("p90", "p99", "max") if spread[k] > 0)]


def profile_rows(dataset: Any, split: str, rules: Rules, rows: int, seed: int,
                 progress: bool = True) -> DataProfile:
    """Profile ``dataset`` (a :class:`easytrain.data.dataset.PromptDataset` opened with ``scan=False``): at most
    ``rows`` of its rows, each built by the training rules."""
    lengths = [len(source) for source in dataset.sources]
    for source in dataset.sources:  # read in file order: one row group at a time is enough
        if hasattr(source, "cache_row_groups"):
            source.cache_row_groups = 1
    profile = DataProfile(split, sum(lengths), rules)
    positions = sample_positions(lengths, rows, seed)
    for s, r in tqdm(positions, desc=f"profiling {split} data", unit="row", disable=not progress):
        try:
            profile.costs.append(row_cost(dataset.build(s, r)))
        except BadSample as bad:
            profile.skipped[bad.reason] += 1
            if bad.measured is not None:
                profile.over.setdefault(bad.reason, []).append(bad.measured)
    return profile


def describe(profile: DataProfile) -> str:
    """The profile as a short table, for the terminal."""
    stats = profile.stats()
    sample = "all rows" if profile.sampled >= profile.rows else f"a sample of {profile.sampled} rows"
    lines = [f"data ({profile.split}): {profile.rows} rows, {sample}; {len(profile.costs)} kept"
             + (f", skipped {dict(sorted(profile.skipped.items()))}" if profile.skipped else ""),
             f"  {'':<15}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}"]
    for name in ("vision_tokens", "prompt_tokens", "images", "pixels"):
        row = stats[name]
        lines.append(f"  {name:<15}" + "".join(f"{row[k]:>10}" for k in ("p50", "p90", "p99", "max")))
    return "\n".join(lines)



def describe_choices(profile: DataProfile) -> str:
    """The costliest rows and what other image and prompt limits would keep, for the terminal."""
    lines = [f"  costliest rows ({profile.split}):"]
    lines += [f"    {c.where}: {c.prompt_tokens} prompt tokens, {c.vision_tokens} vision, {len(c.sizes)} image(s) "
              + " ".join(f"{w}x{h}" for h, w in c.sizes) for c in profile.costliest()]
    lines.append(f"  data.max_pixels ({profile.split}): rows unscaled, vision tokens p99 / max, rows within "
                 f"data.max_prompt_length={profile.rules.max_prompt_length}")
    for row in profile.pixel_candidates(pixel_values(profile)):
        mark = "  (now)" if row["max_pixels"] == profile.rules.max_pixels else ""
        lines.append(f"    {row['max_pixels']:>10}: {100 * row['unscaled_share']:5.1f}%  "
                     f"{row['vision_tokens_p99']:>6} / {row['vision_tokens_max']:<6} "
                     f"{100 * row['within_max_prompt_length_share']:5.1f}%{mark}")
    lengths = ", ".join(f"{r['max_prompt_length']}: {100 * r['kept_share']:.1f}%"
                        for r in profile.length_candidates(length_values(profile)))
    lines.append(f"  data.max_prompt_length, rows kept: {lengths}")
    return "\n".join(lines)
