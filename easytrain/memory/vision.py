"""How a model family turns an image into language-model tokens, read from its HF config: the planner's
image geometry.

Three layouts cover the families easytrain plans:

- dynamic resolution (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the image is resized
  onto a grid of ``patch x merge`` pixel cells (28 px for 14-px patches,
  32 px for Qwen3-VL's 16-px ones); each cell is ``merge x merge`` patches
  merged into one token, and a patch spans ``temporal_patch_size`` frames
  (an image is repeated to fill them);
- tiles (InternVL): the image is resized onto a grid of
  ``vision_config.image_size`` tiles (448 px), plus a thumbnail tile of the
  whole image when there is more than one; a tile's patches are pixel-shuffled
  by ``downsample_ratio`` (0.5: 2 x 2 patches a token), 256 tokens a tile;
- one fixed image (Gemma 3): every image is resized to
  ``vision_config.image_size`` (896 px) and pooled to ``mm_tokens_per_image``
  (256) tokens, whatever its size.

An image at ``data.max_pixels`` takes :meth:`VisionGeometry.image_tokens` tokens; the vision tower sees
``merge x merge`` patches per token, each ``channels x temporal x patch x patch`` fp32 values in
``pixel_values``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

@dataclass(frozen=True)
class VisionGeometry:
    patch: int
    """Patch side in pixels."""
    merge: int
    """Patches per token along a side (2: 2 x 2 patches make one language-model token)."""
    temporal: int
    """Frames one patch spans (Qwen-VL: 2, an image repeated; 1 elsewhere)."""
    cell: int
    """Side in pixels of the cells an image is resized onto (Qwen-VL: patch x merge; InternVL: a tile)."""
    tokens_per_cell: int
    thumbnail: bool = False
    """An image of more than one cell also takes one cell of itself, downscaled (InternVL)."""
    fixed_cells: int = 0
    """Cells of every image, whatever its size (Gemma 3: 1); 0 where the image's size decides."""
    channels: int = 3

    def image_tokens(self, max_pixels: int) -> int:
        """Language-model tokens of one image of at most ``max_pixels`` pixels, resized onto the grid."""
        if self.fixed_cells:
            cells = self.fixed_cells
        else:
            cells = max_pixels // (self.cell * self.cell)
            cells = max(1, cells) if self.thumbnail else cells  # a tiled image is at least one tile
        return (cells + int(self.thumbnail and cells > 1)) * self.tokens_per_cell

    @property
    def patch_values(self) -> int:
        """fp32 values of one patch in ``pixel_values``."""
        return self.channels * self.temporal * self.patch * self.patch

    @property
    def values_per_token(self) -> int:
        """``pixel_values`` values behind one language-model token (its ``merge x merge`` patches)."""
        return self.merge * self.merge * self.patch_values


def vision_geometry(hf_config: dict[str, Any]) -> Optional[VisionGeometry]:
    """The image geometry of the model ``hf_config`` describes, as its family's adapter gives it (its data
    layout and its tower's patches); None for a text-only model or a family without an image layout."""
    return _geometry(json.dumps(hf_config, sort_keys=True))


@lru_cache(maxsize=64)
def _geometry(key: str) -> Optional[VisionGeometry]:
    from easytrain.models.families import family_of

    family = family_of(json.loads(key))  # settings config.json leaves out take the model class's defaults
    layout = family.layout() if family.vision else None
    if layout is None:
        return None
    patch, merge, temporal = family.patch_geometry()
    return VisionGeometry(patch=patch, merge=merge, temporal=temporal, cell=layout.factor,
                          tokens_per_cell=layout.tokens_per_cell, thumbnail=layout.thumbnail,
                          fixed_cells=int(layout.fixed_size),
                          channels=family.channels())
