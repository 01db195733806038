"""The built-in task's tool (``+exp=tiny_tools``): zooming into the sample's image.

``worker.rollout.multi_turn.tools=[easytrain.tools.shapes:zoom]``. The task's scenes
(:mod:`easytrain.data.synthetic`, ``shapes/dot``) are one small dot on white: :func:`zoom` finds it
from the pixels (it is not told where it is or its colour) and returns it enlarged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

INK = 60
"""A pixel is drawn when some channel is at least this far below white."""
MARGIN = 1
"""Pixels of white kept around what is drawn."""
ZOOMED = 112
"""Side of the returned image (pixels): 16 vision tokens at the tiny presets' data.max_pixels."""


def zoom(images: list) -> list:
    """Zoom into what the image shows.

    Returns:
        The drawn part of the image, enlarged.
    """
    from PIL import Image

    if not images:
        raise ValueError("the question has no image to zoom into")
    image = images[0].convert("RGB")
    pixels: Any = np.asarray(image, dtype=np.int16)
    rows, cols = np.nonzero((255 - pixels).max(axis=-1) >= INK)
    if not len(rows):
        raise ValueError("the image is blank: nothing to zoom into")
    box = (max(0, int(cols.min()) - MARGIN), max(0, int(rows.min()) - MARGIN),
           min(image.width, int(cols.max()) + 1 + MARGIN), min(image.height, int(rows.max()) + 1 + MARGIN))
    return [image.crop(box).resize((ZOOMED, ZOOMED), Image.Resampling.NEAREST), "zoomed in"]
