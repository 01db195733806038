"""The plan's sequences from the data instead of the limits: the longest rows a data profile
(:mod:`easytrain.data.profile`) found, re-priced under the limits of the config being planned (a suggestion's
``data.max_pixels`` re-sizes the profiled images; a smaller ``data.max_prompt_length`` or ``data.limit_images``
drops the rows the run would skip).

Padded micro batches are as long as their longest row, so the data's longest row is what a micro batch of the
longest rows costs; a sample of a large dataset may miss its single longest row (the profile states its sample).
A step's phases read the train split's rows, a validation the validation split's (where the data has one).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from easytrain.data.profile import DataProfile, Longest, Rules
from easytrain.memory.budget import SequenceShape, tokens_per_image


@dataclass(frozen=True)
class DataCosts:
    """What the profiles of a run's splits read; the planner prices its sequences by :meth:`shape`."""

    profiles: tuple[DataProfile, ...] = ()
    scanned: tuple[tuple[str, Rules, Longest, tuple[int, ...]], ...] = ()
    """What a run's own read of every row kept (per split, its datasets' :attr:`longest` and each row's vision
    tokens), by the rules it read them by: it prices that run's limits only."""
    _priced: dict[Any, list[int]] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Per (profile, rules): the vision tokens of the rows kept, costliest first (a plan asks several times)."""

    @classmethod
    def of(cls, profiles: Sequence[DataProfile]) -> Optional["DataCosts"]:
        return cls(tuple(profiles)) if profiles else None

    @classmethod
    def read(cls, datasets: Sequence[Any]) -> "DataCosts":
        """The costs of datasets a run has read whole (:class:`easytrain.data.dataset.PromptDataset`)."""
        return cls(scanned=tuple((d.split, d.rules(), d.longest, tuple(sorted(d.vision_tokens, reverse=True))) for d in datasets))

    def why_not(self, config: Any) -> str:
        """Why the data cannot price ``config``'s rows ("" when it can)."""
        d = config.data
        if config.trainer.task != "rl":
            return "the data profile reads RL prompts only"
        if d.video_key:
            return "videos are priced on the limits"
        for _, rules, _, _ in self.scanned:
            if Rules.of(d, rules.layout) != rules:
                return "the data was read under other data limits"
        for p in self.profiles:
            if d.limit_images > p.rules.limit_images and p.over.get("too_many_images"):
                return (f"data.limit_images={d.limit_images} admits rows the profile skipped at "
                        f"{p.rules.limit_images}")
        return ""

    def splits(self) -> set[str]:
        return {p.split for p in self.profiles} | {split for split, _, _, _ in self.scanned}

    def longest(self, config: Any, split: str = "") -> Optional[Longest]:
        """The longest prompt, most images and most vision tokens of the rows ``config``'s limits keep (each read
        under them as the dataset reads it: :func:`easytrain.data.profile.reprice`); of ``split`` when given."""
        kept = [longest for name, _, longest, _ in self.scanned if longest.prompt and split in ("", name)]
        for p in self.profiles:
            if split not in ("", p.split):
                continue
            rules = Rules.of(config.data, p.rules.layout)
            kept += [Longest(q.prompt, q.images, q.image_tokens) for q in p.priced(rules) if q is not None]
        return functools.reduce(Longest.join, kept) if kept else None

    def batch_vision(self, config: Any, split: str, prompts: int) -> Optional[int]:
        """The most vision tokens ``prompts`` rows of ``split`` carry together under ``config``'s limits: a batch's
        pixel values are its prompts' own, not each at the longest row's. Rows read whole (a profile of every
        row, or the run's own read) give the ``prompts`` costliest rows' sum; a sample of a fraction f the sum of
        its costliest ceil(prompts x f) rows over f, the sample standing for the rows it was drawn from (at most
        ``prompts`` x its costliest row, which a small fraction comes to). None where the data cannot say
        (:meth:`why_not`, or no read of ``split``)."""
        if self.why_not(config):
            return None
        found = [sum(tokens[:prompts]) for name, _, _, tokens in self.scanned if name == split]
        for p in self.profiles:
            if p.split != split:
                continue
            tokens = self._costliest(p, Rules.of(config.data, p.rules.layout))
            if tokens:
                drawn = -(-prompts * p.sampled // max(1, p.rows))  # ceil(prompts x f), in integers
                found.append(min(-(-sum(tokens[:drawn]) * p.rows // max(1, p.sampled)), prompts * tokens[0]))
        return max(found) if found else None

    def _costliest(self, profile: DataProfile, rules: Rules) -> list[int]:
        key = (id(profile), rules)
        if key not in self._priced:
            self._priced[key] = sorted((q.image_tokens for q in profile.priced(rules) if q), reverse=True)
        return self._priced[key]

    def shape(self, config: Any, hf_config: dict[str, Any], split: str = "") -> Optional[SequenceShape]:
        """The data's longest sequence under ``config``'s limits (None where :meth:`why_not` says why, or no row is
        kept): the longest prompt, with the most images and vision tokens a row has (each at most what the
        longest such row takes), multi-turn tool images at ``data.max_pixels`` beside them (as the limits price
        them), and responses at ``data.max_response_length``. ``split``: of that split's rows (every split's
        where the data has not read it)."""
        if self.why_not(config):
            return None
        top = self.longest(config, split if split in self.splits() else "")
        if top is None:
            return None
        d, turns = config.data, config.worker.rollout.multi_turn
        tool_tokens = tokens_per_image(hf_config, d.max_pixels) if d.image_key else 0
        tools = turns.max_tool_images if turns.enable and tool_tokens else 0
        per_image = -(-top.vision // top.images) if top.images else 0
        if tools:
            per_image = max(per_image, tool_tokens)
        images = top.images + tools
        return SequenceShape(max(0, top.prompt - images * per_image), images, per_image, d.max_response_length)
