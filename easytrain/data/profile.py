"""What a dataset's rows will cost, read before launch by the training rules: per row its images as decoded, the
vision and prompt tokens after the resize rules and the chat template; the distribution (p50, p90, p99, max), the
costliest rows by name, and what other limits (``data.max_pixels``, ``data.max_prompt_length``,
``data.limit_images``) would keep.

Large data is sampled: at most ``data.profile_rows`` rows per split, drawn uniformly without replacement (seeded)
and read in file order, so a parquet file is read one row group at a time. A row the run would skip is counted by
the reason the run's ``data_report.json`` gives it; the whole split read gives the same counts.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Sequence

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
    rank = {f"p{q}": ordered[max(0, -(-q * len(ordered) // 100) - 1)] for q in PERCENTILES}  # ceil(q n / 100)
    return {**rank, "max": ordered[-1]}


@dataclass(frozen=True)
class Longest:
    """The largest of each count over a split's kept rows (not necessarily one row's)."""

    prompt: int = 0
    images: int = 0
    vision: int = 0
    """Vision tokens of a row's images."""

    def add(self, cost: RowCost) -> "Longest":
        return self.join(Longest(cost.prompt_tokens, len(cost.sizes), sum(cost.image_tokens)))

    def join(self, other: "Longest") -> "Longest":
        return Longest(max(self.prompt, other.prompt), max(self.images, other.images), max(self.vision, other.vision))


@dataclass(frozen=True)
class Rules:
    """The data limits rows are read under, and the family's grid (to re-price images under other limits)."""

    min_pixels: int
    max_pixels: int
    max_prompt_length: int
    limit_images: int
    layout: Layout
    downscale: bool = False
    """``data.downscale_images_to_fit``."""

    @classmethod
    def of(cls, data: Any, layout: Layout) -> "Rules":
        """The rules of a config's ``data`` section."""
        return cls(data.min_pixels, data.max_pixels, data.max_prompt_length, data.limit_images, layout,
                   data.downscale_images_to_fit)


class Priced(NamedTuple):
    """A row as the run would read it under some :class:`Rules`."""

    prompt: int
    images: int
    image_tokens: int
    whole: bool
    """Every image keeps its full size (``data.max_pixels`` does not shrink it)."""


def downscale_share(max_prompt_length: int, other_tokens: int, images: int) -> int:
    """Vision tokens each image may take when a prompt's images are shrunk to fit (``data.downscale_images_to_fit``):
    an equal share of what the text (and videos), ``other_tokens``, leave free; below 1 the row is skipped."""
    return (max_prompt_length - other_tokens) // images


def reprice(cost: RowCost, rules: Rules) -> Optional[Priced]:
    """``cost``'s row read under ``rules`` as the dataset reads it (its images sized from their decoded sizes,
    shrunk to fit where the rules say so); None when the run would skip it."""
    layout, other = rules.layout, cost.text_tokens + cost.video_tokens
    if len(cost.sizes) > rules.limit_images:
        return None
    sized = [_sized(h, w, rules.min_pixels, rules.max_pixels, layout) for h, w in cost.sizes]
    whole = all(s == _sized(h, w, rules.min_pixels, UNBOUNDED, layout) for s, (h, w) in zip(sized, cost.sizes))
    tokens = sum(layout.image_tokens(*s) for s in sized)
    if other + tokens > rules.max_prompt_length:
        share = downscale_share(rules.max_prompt_length, other, len(cost.sizes)) if cost.sizes else 0
        if not rules.downscale or share < 1:
            return None
        most = layout.pixels_for(share)
        tokens = sum(layout.image_tokens(*_sized(h, w, min(rules.min_pixels, most), most, layout))
                     for h, w in cost.sizes)  # may stay over the limit (one fixed size, a tile's thumbnail): kept so
        whole = False
    return Priced(other + tokens, len(cost.sizes), tokens, whole)


@dataclass
class DataProfile:
    """The costs of a split's sampled rows and the counts of those the run would skip."""

    split: str
    rows: int
    """Rows in the split."""
    rules: Rules
    costs: list[RowCost] = field(default_factory=list)
    """The rows the run keeps."""
    too_long: list[RowCost] = field(default_factory=list)
    """Rows skipped over ``data.max_prompt_length`` (at full size): other limits may keep them."""
    skipped: Counter = field(default_factory=Counter)
    """Sampled rows the run would skip, by reason (``data_report.json``'s)."""
    over: dict[str, list[int]] = field(default_factory=dict)
    """For rows skipped at a count limit, what they measured (``too_many_images``: images; ``too_many_videos``)."""

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

    def priced(self, rules: Rules) -> list[Optional[Priced]]:
        """Every row that got as far as its prompt (kept, or skipped for length) read under ``rules``."""
        return [reprice(c, rules) for c in self.costs + self.too_long]

    def pixel_candidates(self, values: Sequence[int]) -> list[dict[str, Any]]:
        """For each ``data.max_pixels`` value: of the rows that got as far as their prompt, the share the run keeps
        and the share whose images keep their full size; the kept rows' vision tokens (p99, max) and their prompt
        tokens (max). Empty for a family that sizes every image to one fixed size."""
        if self.rules.layout.fixed_size:
            return []
        out = []
        for value in sorted(set(values)):
            priced = self.priced(dataclasses.replace(self.rules, max_pixels=value))
            kept = [p for p in priced if p is not None]
            spread = percentiles([p.image_tokens for p in kept])
            total = max(1, len(priced))
            out.append({"max_pixels": value, "kept_share": len(kept) / total,
                        "unscaled_share": sum(p.whole for p in kept) / total, "vision_tokens_p99": spread["p99"],
                        "vision_tokens_max": spread["max"], "prompt_tokens_max": max((p.prompt for p in kept),
                                                                                     default=0)})
        return out

    def length_candidates(self, values: Sequence[int]) -> list[dict[str, Any]]:
        """For each ``data.max_prompt_length`` value: the share of the sampled rows (kept or skipped for length)
        whose prompt fits."""
        lengths = [c.prompt_tokens for c in self.costs + self.too_long]
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


def _sized(height: int, width: int, min_pixels: int, max_pixels: int, layout: Layout) -> tuple[int, int]:
    """An image's size on the grid as the dataset sizes it (:meth:`easytrain.data.dataset.PromptDataset.fit`)."""
    if layout.fixed_size:
        return layout.factor, layout.factor
    return smart_resize(height, width, min(min_pixels, max_pixels), max_pixels, layout.factor)


def pixel_values(profile: DataProfile) -> list[int]:
    """``data.max_pixels`` values worth comparing: the configured one, a quarter, half, twice and four times it,
    and the grid-rounded pixels of the data's images at p50, p90, p99 and max."""
    r = profile.rules
    if r.layout.fixed_size:
        return []
    cell = r.layout.factor * r.layout.factor
    sizes = [h * w for c in profile.costs for h, w in c.sizes]
    spread = percentiles(sizes) if sizes else {}
    data = [max(cell, round(v / cell) * cell) for v in spread.values()]
    return [v for v in {r.max_pixels // 4, r.max_pixels // 2, r.max_pixels, 2 * r.max_pixels, 4 * r.max_pixels,
                        *data} if v >= max(cell, r.min_pixels)]


def length_values(profile: DataProfile) -> list[int]:
    """``data.max_prompt_length`` values worth comparing: the configured one and the data's p90, p99 and max."""
    spread = percentiles([c.prompt_tokens for c in profile.costs + profile.too_long])
    return [profile.rules.max_prompt_length, *(int(spread[k]) for k in ("p90", "p99", "max") if spread[k] > 0)]


def profile_rows(dataset: Any, split: str, rows: int, seed: int, progress: bool = True) -> DataProfile:
    """Profile ``dataset`` (a :class:`easytrain.data.dataset.PromptDataset` opened with ``scan=False``): at most
    ``rows`` of its rows, each built by the training rules."""
    lengths = [len(source) for source in dataset.sources]
    for source in dataset.sources:  # read in file order: one row group at a time is enough
        if hasattr(source, "cache_row_groups"):
            source.cache_row_groups = 1
    profile = DataProfile(split, sum(lengths), dataset.rules())
    positions = sample_positions(lengths, rows, seed)
    for s, r in tqdm(positions, desc=f"profiling {split} data", unit="row", disable=not progress):
        try:
            profile.costs.append(row_cost(dataset.build(s, r)))
        except BadSample as bad:
            profile.skipped[bad.reason] += 1
            if bad.cost is not None:  # over the prompt limit: its whole cost, priced again under other limits
                profile.too_long.append(bad.cost)
            elif bad.measured is not None:
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



def describe_choices(profile: DataProfile, peaks: Optional[dict[int, str]] = None) -> str:
    """The costliest rows and what other image and prompt limits would keep, for the terminal; ``peaks``: the plan's
    peaks at each ``data.max_pixels`` value, as text."""
    peaks = peaks or {}
    lines = [f"  costliest rows ({profile.split}):"]
    lines += [f"    {c.where}: {c.prompt_tokens} prompt tokens, {c.vision_tokens} vision, {len(c.sizes)} image(s) "
              + " ".join(f"{w}x{h}" for h, w in c.sizes) for c in profile.costliest()]
    table = profile.pixel_candidates(pixel_values(profile))
    if table:
        lines.append(f"  data.max_pixels ({profile.split}): rows kept, rows at full size, vision tokens p99 / max"
                     + ("; the plan's peaks" if peaks else ""))
    else:
        lines.append("  data.max_pixels: this family sizes every image to one fixed size")
    for row in table:
        mark = "  (now)" if row["max_pixels"] == profile.rules.max_pixels else ""
        lines.append(f"    {row['max_pixels']:>10}: {100 * row['kept_share']:5.1f}%  "
                     f"{100 * row['unscaled_share']:5.1f}%  {row['vision_tokens_p99']:>6} / "
                     f"{row['vision_tokens_max']:<6} {peaks.get(row['max_pixels'], '')}{mark}")
    lengths = ", ".join(f"{r['max_prompt_length']}: {100 * r['kept_share']:.1f}%"
                        for r in profile.length_candidates(length_values(profile)))
    lines.append(f"  data.max_prompt_length, rows kept: {lengths}")
    return "\n".join(lines)
