"""Batches of prompts as the tensors the models take.

:class:`PromptCollator` left-pads token ids, marks vision tokens
(``mm_token_type_ids``) and has the model family's adapter build the vision
stream (which then travels with the batch) and the position ids
(:class:`Visuals`: multimodal rotary rows or plain positions); a text model
takes plain positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Sequence

import torch

from easytrain.data.dataset import Prompt
from easytrain.data.video import Clip
from easytrain.data.vision import mm_token_type_ids, visual_order


class Visuals(Protocol):
    """A model family's vision inputs, as a collator builds them (:class:`easytrain.models.families.Bound`)."""

    image_token_id: int
    video_token_id: int

    def stream(self, images: Sequence[Sequence[Any]], videos: Sequence[Sequence[Clip]],
               order: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """The vision stream (:data:`easytrain.data.vision.VISUAL_KEYS`) of samples' sized images and videos, each
        sample's in text order (``order``: :func:`easytrain.data.vision.visual_order`); empty without visuals."""

    def positions(self, input_ids: torch.Tensor, types: torch.Tensor, tensors: Mapping[str, Any],
                  attention_mask: torch.Tensor) -> torch.Tensor:
        """Position ids of the batch (``tensors``: its vision stream)."""


def vision_inputs(visuals: Visuals, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  images: Sequence[Sequence[Any]], videos: Sequence[Sequence[Clip]]) -> dict[str, torch.Tensor]:
    """``mm_token_type_ids``, the vision stream and the position ids of a padded batch."""
    types = mm_token_type_ids(input_ids, visuals.image_token_id, visuals.video_token_id)
    out: dict[str, torch.Tensor] = {"mm_token_type_ids": types}
    out.update(visuals.stream(images, videos, visual_order(types, attention_mask)))
    out["position_ids"] = visuals.positions(input_ids, types, out, attention_mask)
    return out


def text_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """1-D positions counting only real tokens (padding gets 0), for text-only models."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask


@dataclass
class PromptCollator:
    """Picklable collate function (it runs in data-loader worker processes)."""

    pad_token_id: int
    visuals: Optional[Visuals] = None
    """The model family's vision inputs; None: text only (plain positions)."""

    def __call__(self, prompts: Sequence[Prompt]) -> dict[str, Any]:
        longest = max(len(p.input_ids) for p in prompts)
        input_ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: generation appends on the right
            input_ids[i, longest - len(p.input_ids):] = torch.tensor(p.input_ids)
            attention_mask[i, longest - len(p.input_ids):] = 1
        batch: dict[str, Any] = {
            "input_ids": input_ids, "attention_mask": attention_mask,
            "uids": [p.uid for p in prompts], "answers": [p.answer for p in prompts],
            "images": [p.images for p in prompts],
            "visual_counts": [len(p.images) + len(p.videos) for p in prompts],
        }
        if self.visuals is None:
            batch["position_ids"] = text_positions(attention_mask)
            return batch
        batch.update(vision_inputs(self.visuals, input_ids, attention_mask, [p.images for p in prompts],
                                   [p.videos for p in prompts]))
        return batch
