"""Vision-token bookkeeping shared by the data pipeline and the models.

Qwen-VL models see an image as ``grid_t x grid_h x grid_w`` patches of 14 px,
merged ``merge_size x merge_size`` into one token each. The chat template
writes one ``<|image_pad|>`` per image; before the model sees the text each is
expanded to the image's token count, so the number of image tokens equals the
number of image features by construction.
"""

from __future__ import annotations

from typing import Sequence

import torch

IMAGE_PAD = "<|image_pad|>"
MM_TEXT, MM_IMAGE, MM_VIDEO = 0, 1, 2
"""Values of ``mm_token_type_ids``: which tokens are text, image or video."""


def image_token_counts(image_grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Tokens each image occupies: t * h * w patches / merge_size**2."""
    return [int(n) for n in (image_grid_thw.prod(dim=-1) // (merge_size * merge_size)).tolist()]


def expand_image_placeholders(text: str, counts: Sequence[int], placeholder: str = IMAGE_PAD) -> str:
    """Replace the i-th placeholder with ``counts[i]`` copies; the counts must match the placeholders."""
    parts = text.split(placeholder)
    if len(parts) - 1 != len(counts):
        raise ValueError(f"text has {len(parts) - 1} image placeholders but {len(counts)} images were given")
    out = [parts[0]]
    for count, rest in zip(counts, parts[1:]):
        out.append(placeholder * count)
        out.append(rest)
    return "".join(out)


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int, video_token_id: int = -1) -> torch.Tensor:
    """Mark image (1) and video (2) tokens; Qwen-VL uses this to build 3-D rope positions."""
    types = torch.zeros_like(input_ids)
    types[input_ids == image_token_id] = MM_IMAGE
    if video_token_id >= 0:
        types[input_ids == video_token_id] = MM_VIDEO
    return types
