"""The plan's sequences from the data instead of the limits: the longest rows a data profile
(:mod:`easytrain.data.profile`) found, re-priced under the limits of the config being planned (a suggestion's
``data.max_pixels`` re-sizes the profiled images; a smaller ``data.max_prompt_length`` or ``data.limit_images``
drops the rows the run would skip).

Padded micro batches are as long as their longest row, so the data's longest row is what a micro batch of the
longest rows costs; a sample of a large dataset may miss its single longest row (the profile states its sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from easytrain.data.profile import DataProfile
from easytrain.memory.budget import SequenceShape, tokens_per_image


@dataclass(frozen=True)
class Longest:
    """The largest of each count over the rows a config keeps."""

    prompt: int
    images: int
    vision: int


@dataclass(frozen=True)
class DataCosts:
    """What the profiles of a run's splits read; the planner prices its sequences by :meth:`shape`."""

    profiles: tuple[DataProfile, ...]

    @classmethod
    def of(cls, profiles: Sequence[DataProfile]) -> Optional["DataCosts"]:
        return cls(tuple(profiles)) if profiles else None

    def why_not(self, config: Any) -> str:
        """Why the profiles cannot price ``config``'s rows ("" when they can)."""
        d = config.data
        if config.trainer.task != "rl":
            return "the data profile reads RL prompts only"
        for p in self.profiles:
            r = p.rules
            if d.limit_images > r.limit_images and p.over.get("too_many_images"):
                return f"data.limit_images={d.limit_images} admits rows the profile skipped at {r.limit_images}"
            if d.max_prompt_length > r.max_prompt_length and p.over.get("prompt_too_long"):
                return (f"data.max_prompt_length={d.max_prompt_length} admits rows the profile skipped at "
                        f"{r.max_prompt_length}")
            if d.min_pixels != r.min_pixels:
                return f"data.min_pixels={d.min_pixels} differs from the profile's {r.min_pixels}"
            if any(c.video_tokens for c in p.costs):
                return "videos are priced on the limits"
        return ""

    def longest(self, config: Any) -> Optional[Longest]:
        """The longest prompt, most images and most vision tokens of the rows ``config``'s limits keep."""
        d = config.data
        prompt = images = vision = 0
        kept = False
        for p in self.profiles:
            for cost, tokens, _ in p.image_tokens_under(d.max_pixels):
                length = cost.text_tokens + tokens
                if len(cost.sizes) > d.limit_images:
                    continue
                if length > d.max_prompt_length:
                    if not (d.downscale_images_to_fit and cost.sizes):
                        continue
                    length = d.max_prompt_length  # its images shrink until it fits
                    tokens = min(tokens, d.max_prompt_length - cost.text_tokens)
                kept = True
                prompt, images, vision = max(prompt, length), max(images, len(cost.sizes)), max(vision, tokens)
        return Longest(prompt, images, vision) if kept else None

    def shape(self, config: Any, hf_config: dict[str, Any]) -> Optional[SequenceShape]:
        """The data's longest sequence under ``config``'s limits (None where :meth:`why_not` says why, or no row is
        kept): the longest prompt, with the most images and vision tokens a row has (each at most what the
        longest such row takes), multi-turn tool images at ``data.max_pixels`` beside them, and responses at
        ``data.max_response_length``."""
        if self.why_not(config):
            return None
        top = self.longest(config)
        if top is None:
            return None
        turns = config.worker.rollout.multi_turn
        tools = turns.max_tool_images if turns.enable and top.images else 0
        per_image = -(-top.vision // top.images) if top.images else 0
        if tools:
            per_image = max(per_image, tokens_per_image(hf_config, config.data.max_pixels))
        images = top.images + tools
        return SequenceShape(max(0, top.prompt - images * per_image), images, per_image,
                             config.data.max_response_length)
