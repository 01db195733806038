"""Vision-token bookkeeping shared by the data pipeline and the models.

A model family sees an image as some number of vision tokens (its
:class:`Layout`, built by the family's adapter in ``easytrain/models/families``):
the chat template writes one placeholder per image, and before the model sees
the text each is expanded to the image's token count, so the number of image
tokens equals the number of image features by construction. A video (the
families that take them) is the tower's input with ``grid_t > 1`` behind its
own placeholder.

A batch carries its images and videos as one vision stream, in the order their
placeholders appear in each sample: ``pixel_values`` (every visual's rows back
to back: patch rows, tiles or whole images, as the family lays them out),
``image_grid_thw`` (a row per visual, whose product is its row count) and
``visual_seconds`` (per visual, the seconds one temporal patch spans; 0 for a
still image). Only the family's adapter turns the stream into the model's
arguments, so selecting, packing and sharing prompts handle every family's
visuals alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISUAL_KEYS = ("pixel_values", "image_grid_thw", "visual_seconds")
"""A batch's vision stream (see the module docstring)."""
MM_TEXT, MM_IMAGE, MM_VIDEO = 0, 1, 2
"""Values of ``mm_token_type_ids``: which tokens are text, image or video."""


@dataclass(frozen=True)
class Layout:
    """How a model family sees an image, as far as the data pipeline needs to know: onto which grid an image is
    resized, how many vision tokens it then takes, and how its placeholder is written out. The family's adapter
    (:mod:`easytrain.models.families`) builds it; the defaults are the 28-px grid of 14-px patches merged 2x2."""

    factor: int = 28
    """An image is resized to multiples of this many pixels per side (a cell)."""
    tokens_per_cell: int = 1
    """Vision tokens per ``factor x factor`` cell."""
    thumbnail: bool = False
    """An image of more than one cell also takes one cell of itself downscaled (tiled families)."""
    fixed_size: bool = False
    """Every image is resized to exactly one cell, its aspect ratio not kept (the family's tower takes one size)."""
    image_pad: str = IMAGE_PAD
    """The token the chat template writes once per image, expanded to one per vision token."""
    image_fill: str = ""
    """The token repeated once per vision token where it is not ``image_pad`` itself (e.g. soft tokens between begin/end markers)."""
    video_pad: str = VIDEO_PAD
    image_open: str = ""
    """Text written before each image's expanded pads (where the template leaves it to the processor)."""
    image_close: str = ""

    @property
    def image_token(self) -> str:
        """The token the model finds its image features at (one per vision token)."""
        return self.image_fill or self.image_pad

    def image_tokens(self, height: int, width: int) -> int:
        """Vision tokens of an image already resized onto the grid."""
        if self.fixed_size:
            return self.tokens_per_cell
        cells = (height // self.factor) * (width // self.factor)
        return (cells + int(self.thumbnail and cells > 1)) * self.tokens_per_cell

    def pixels_for(self, tokens: int) -> int:
        """The most pixels an image may have to take at most ``tokens`` vision tokens (thumbnail aside)."""
        return tokens * self.factor * self.factor // self.tokens_per_cell

    def expand(self, text: str, image_tokens: Sequence[int], video_tokens: Sequence[int] = ()) -> str:
        """``text`` with each image and video placeholder expanded to its visual's token count, in order."""
        text = expand_image_placeholders(text, image_tokens, self.image_pad, self.image_open, self.image_close,
                                         self.image_fill)
        return expand_image_placeholders(text, video_tokens, self.video_pad)


def image_token_counts(image_grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Tokens each image occupies: t * h * w patches / merge_size**2."""
    return [int(n) for n in (image_grid_thw.prod(dim=-1) // (merge_size * merge_size)).tolist()]


def expand_image_placeholders(text: str, counts: Sequence[int], placeholder: str = IMAGE_PAD, before: str = "",
                              after: str = "", fill: str = "") -> str:
    """Replace the i-th placeholder with ``counts[i]`` copies of it (of ``fill`` where given), between ``before``
    and ``after``; the counts must match the placeholders."""
    parts = text.split(placeholder)
    if len(parts) - 1 != len(counts):
        raise ValueError(f"text has {len(parts) - 1} image placeholders but {len(counts)} images were given")
    out = [parts[0]]
    for count, rest in zip(counts, parts[1:]):
        out.append(before + (fill or placeholder) * count + after)
        out.append(rest)
    return "".join(out)


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int, video_token_id: int = -1) -> torch.Tensor:
    """Mark image (1) and video (2) tokens (multimodal rope positions, prompt sharing and packing read them)."""
    types = torch.zeros_like(input_ids)
    types[input_ids == image_token_id] = MM_IMAGE
    if video_token_id >= 0:
        types[input_ids == video_token_id] = MM_VIDEO
    return types


def visual_order(token_types: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Per sample, the kinds of its visuals in text order (MM_IMAGE or MM_VIDEO, one per placeholder run)."""
    out = []
    for b in range(token_types.shape[0]):
        kinds = token_types[b][attention_mask[b].bool()].tolist()
        out.append([k for i, k in enumerate(kinds) if k != MM_TEXT and (i == 0 or kinds[i - 1] != k)])
    return out
