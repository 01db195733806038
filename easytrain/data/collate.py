"""Batches of prompts as the tensors Qwen models take.

:class:`PromptCollator` left-pads token ids, runs the image processor once per
image (the processed ``pixel_values`` then travel with the batch), and builds
``mm_token_type_ids`` and position ids: Qwen-VL's 3-D rope positions
(temporal, height, width) for the VL families, plain positions otherwise.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from easytrain.data.dataset import Prompt
from easytrain.data.images import MERGE_SIZE
from easytrain.data.vision import MM_TEXT, mm_token_type_ids


def rope_positions(input_ids: torch.Tensor, token_types: torch.Tensor, image_grid_thw: Optional[torch.Tensor],
                   attention_mask: torch.Tensor, merge_size: int = MERGE_SIZE) -> torch.Tensor:
    """Qwen-VL 3-D rope positions ``(3, batch, length)`` for text and images (no video).

    Text advances all three axes together; an image of ``t x h x w`` merged
    patches takes temporal/height/width offsets from the position where it
    starts, and the text after it resumes at ``start + max(h, w)``. Padding
    gets position 0.
    """
    positions = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    grids = iter(image_grid_thw.tolist()) if image_grid_thw is not None else iter(())
    for b in range(input_ids.shape[0]):
        keep = attention_mask[b].bool()
        types = token_types[b][keep].tolist()
        pieces = []
        current = 0
        for kind, group in itertools.groupby(types):
            length = len(list(group))
            if kind == MM_TEXT:
                pieces.append(torch.arange(current, current + length).expand(3, -1))
                current += length
                continue
            t, h, w = next(grids)
            gh, gw = h // merge_size, w // merge_size
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            block = torch.stack([tt, hh, ww]).reshape(3, -1) + current
            if block.shape[1] != length:
                raise ValueError(f"sample {b}: image grid {t}x{h}x{w} gives {block.shape[1]} tokens, "
                                 f"the text holds {length}")
            pieces.append(block)
            current += max(gh, gw)
        positions[:, b, keep] = torch.cat(pieces, dim=1)
    return positions


def text_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """1-D positions counting only real tokens (padding gets 0), for text-only models."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask


@dataclass
class PromptCollator:
    """Picklable collate function (it runs in data-loader worker processes)."""

    pad_token_id: int
    image_processor: Any = None
    image_token_id: int = -1
    video_token_id: int = -1

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
            "vllm_prompts": [p.vllm_text for p in prompts], "images": [p.images for p in prompts],
        }
        images = [im for p in prompts for im in p.images]
        if self.image_processor is None:
            batch["position_ids"] = text_positions(attention_mask)
            return batch
        types = mm_token_type_ids(input_ids, self.image_token_id, self.video_token_id)
        batch["mm_token_type_ids"] = types
        grid = None
        if images:
            processed = self.image_processor(images=images, return_tensors="pt")
            batch["pixel_values"], grid = processed["pixel_values"], processed["image_grid_thw"]
            batch["image_grid_thw"] = grid
        batch["position_ids"] = rope_positions(input_ids, types, grid, attention_mask,
                                               getattr(self.image_processor, "merge_size", MERGE_SIZE))
        return batch
