"""How a model family turns an image into language-model tokens, as its adapter reads them from its HF config
(:mod:`easytrain.models.families`): the planner's image geometry.

Three layouts cover the families easytrain plans:

- dynamic resolution: the image is resized onto a grid of ``patch x merge``
  pixel cells (28 px for 14-px patches, 32 px for 16-px ones); each cell is
  ``merge x merge`` patches merged into one token, and a patch may span
  several frames (an image is repeated to fill them);
- tiles: the image is resized onto a grid of ``vision_config.image_size``
  tiles (e.g. 448 px), plus a thumbnail tile of the whole image when there
  is more than one; a tile's patches are pixel-shuffled by
  ``downsample_ratio`` (0.5: 2 x 2 patches a token);
- one fixed image: every image is resized to ``vision_config.image_size``
  and becomes a fixed count of tokens (pooled, or one a patch), whatever
  its size.

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
    """Frames one patch spans (2 where the tower takes frame pairs, an image repeated; else 1)."""
    cell: int
    """Side in pixels of the cells an image is resized onto (patch x merge, or a tile)."""
    tokens_per_cell: int
    thumbnail: bool = False
    """An image of more than one cell also takes one cell of itself, downscaled (tiled families)."""
    fixed_cells: int = 0
    """Cells of every image, whatever its size (a fixed-size family: 1); 0 where the image's size decides."""
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
