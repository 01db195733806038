"""Batches of prompts as the tensors Qwen models take.

:class:`PromptCollator` left-pads token ids, runs the image processor once per
image and patchifies each video (the processed vision stream then travels with
the batch), and builds
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
from easytrain.data.video import Clip, video_patches
from easytrain.data.vision import MM_TEXT, MM_VIDEO, mm_token_type_ids, visual_order


def rope_positions(input_ids: torch.Tensor, token_types: torch.Tensor, image_grid_thw: Optional[torch.Tensor],
                   attention_mask: torch.Tensor, merge_size: int = MERGE_SIZE,
                   visual_seconds: Optional[torch.Tensor] = None,
                   tokens_per_second: Optional[float] = None) -> torch.Tensor:
    """Qwen-VL 3-D rope positions ``(3, batch, length)`` for text, images and videos.

    Text advances all three axes together; a visual of ``t x h x w`` merged
    patches takes temporal/height/width offsets from the position where it
    starts, and the text after it resumes at ``start + max(h, w)``. A video's
    temporal offsets step by ``tokens_per_second * visual_seconds`` per
    temporal patch (Qwen2.5-VL: positions keep real time; None for Qwen2-VL,
    which steps by 1). ``image_grid_thw`` and ``visual_seconds`` are the
    batch's vision stream (images and videos in text order). Padding gets
    position 0.
    """
    positions = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    grids = iter(image_grid_thw.tolist()) if image_grid_thw is not None else iter(())
    seconds = iter(visual_seconds.tolist()) if visual_seconds is not None else itertools.repeat(0.0)
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
            step = next(seconds)
            # float32 like the model's own spacing (second_per_grid_ts), so the truncation below rounds alike
            interval = (tokens_per_second * torch.tensor(step, dtype=torch.float32)
                        if kind == MM_VIDEO and tokens_per_second else 1)
            gh, gw = h // merge_size, w // merge_size
            times = (torch.arange(t) * interval).long()
            tt, hh, ww = torch.meshgrid(times, torch.arange(gh), torch.arange(gw), indexing="ij")
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


def vision_stream(processor: Any, images: Sequence[Sequence[Any]], videos: Sequence[Sequence[Clip]],
                  order: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """The vision stream (:data:`easytrain.data.vision.VISUAL_KEYS`) of samples' sized images and videos, each
    sample's visuals in its text order (``order``: MM_IMAGE / MM_VIDEO per placeholder, as
    :func:`easytrain.data.vision.visual_order` reads them from the tokens); empty without visuals. Images go through
    the image processor in one call, videos through :func:`easytrain.data.video.video_patches`."""
    flat = [im for sample in images for im in sample]
    if not flat and not any(videos):
        return {}
    pixels: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    if flat:
        processed = processor(images=flat, return_tensors="pt")
        sizes = processed["image_grid_thw"].prod(-1).tolist()
        pixels = list(torch.split(processed["pixel_values"], sizes))
        grids = list(processed["image_grid_thw"])
    image_iter, out_pixels, out_grids, seconds = iter(zip(pixels, grids)), [], [], []
    for sample_videos, kinds in zip(videos, order):
        video_iter = iter(sample_videos)
        for kind in kinds:
            if kind == MM_VIDEO:
                clip = next(video_iter)
                patch, grid = video_patches(clip.frames, processor)
                out_pixels.append(patch)
                out_grids.append(grid[0])
                seconds.append(clip.seconds_per_patch)
            else:
                patch, grid = next(image_iter)
                out_pixels.append(patch)
                out_grids.append(grid)
                seconds.append(0.0)
    return {"pixel_values": torch.cat(out_pixels), "image_grid_thw": torch.stack(out_grids),
            "visual_seconds": torch.tensor(seconds, dtype=torch.float32)}


@dataclass
class PromptCollator:
    """Picklable collate function (it runs in data-loader worker processes)."""

    pad_token_id: int
    image_processor: Any = None
    image_token_id: int = -1
    video_token_id: int = -1
    tokens_per_second: Optional[float] = None
    """The model's video time scale (Qwen2.5-VL's ``vision_config.tokens_per_second``; None: Qwen2-VL)."""

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
            "visual_counts": [len(p.images) + len(p.videos) for p in prompts],
        }
        if self.image_processor is None:
            batch["position_ids"] = text_positions(attention_mask)
            return batch
        types = mm_token_type_ids(input_ids, self.image_token_id, self.video_token_id)
        batch["mm_token_type_ids"] = types
        batch.update(vision_stream(self.image_processor, [p.images for p in prompts], [p.videos for p in prompts],
                                   visual_order(types, attention_mask)))
        batch["position_ids"] = rope_positions(input_ids, types, batch.get("image_grid_thw"), attention_mask,
                                               getattr(self.image_processor, "merge_size", MERGE_SIZE),
                                               batch.get("visual_seconds"), self.tokens_per_second)
        return batch
