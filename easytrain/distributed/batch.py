"""The batch that travels between the driver and worker groups.

Most tensors have one row per sample. Images are packed: ``pixel_values``
holds the patch rows of every image back to back and ``image_grid_thw`` one
row per image, so splitting or selecting samples must carry the right image
and patch ranges along; :class:`Batch` does that, so dispatch code and
workers never re-derive it. Python lists (uids, answers, PIL images for
vLLM) ride in ``meta``, one entry per sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

PACKED_PATCH_KEYS = ("pixel_values",)
PACKED_IMAGE_KEYS = ("image_grid_thw",)
PAD_VALUES = {"targets": -100}
"""What right padding holds per tensor when batches of different widths are joined (0 for the rest): SFT
targets are ignored there (the label index cross-entropy skips)."""


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)
    image_counts: Optional[torch.Tensor] = None
    """Images per sample (needed to split packed image tensors); None when there are no images."""

    def __len__(self) -> int:
        for key, value in self.tensors.items():
            if key not in PACKED_PATCH_KEYS + PACKED_IMAGE_KEYS:
                return int(value.shape[self._sample_dim(key, value)])
        for value in self.meta.values():
            return len(value)
        return 0

    @staticmethod
    def _sample_dim(key: str, value: torch.Tensor) -> int:
        return 1 if key == "position_ids" and value.dim() == 3 else 0  # Qwen-VL rope positions: (3, batch, length)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def _image_ranges(self) -> tuple[list[int], list[int]]:
        """Cumulative image and patch offsets per sample boundary."""
        assert self.image_counts is not None
        image_offsets = [0] + torch.cumsum(self.image_counts, 0).tolist()
        patches = self.tensors["image_grid_thw"].prod(-1) if "image_grid_thw" in self.tensors else None
        patch_offsets = [0] + (torch.cumsum(patches, 0).tolist() if patches is not None else [])
        return image_offsets, patch_offsets

    def select(self, indices: Sequence[int]) -> "Batch":
        """The samples at ``indices`` (in that order), with their images."""
        index = torch.as_tensor(list(indices), dtype=torch.long)
        out = Batch(meta={k: [v[i] for i in indices] for k, v in self.meta.items()})
        for key, value in self.tensors.items():
            if key not in PACKED_PATCH_KEYS + PACKED_IMAGE_KEYS:
                out.tensors[key] = value.index_select(self._sample_dim(key, value), index)
        if self.image_counts is not None:
            out.image_counts = self.image_counts[index]
            image_offsets, patch_offsets = self._image_ranges()
            images = [j for i in indices for j in range(image_offsets[i], image_offsets[i + 1])]
            for key in PACKED_IMAGE_KEYS:
                if key in self.tensors:
                    out.tensors[key] = self.tensors[key][images]
            patches = [p for j in images for p in range(patch_offsets[j], patch_offsets[j + 1])]
            for key in PACKED_PATCH_KEYS:
                if key in self.tensors:
                    out.tensors[key] = self.tensors[key][patches]
        return out

    def split(self, parts: int) -> list["Batch"]:
        """``parts`` contiguous chunks whose sizes differ by at most one."""
        n = len(self)
        bounds = [n * p // parts for p in range(parts + 1)]
        return [self.select(range(bounds[p], bounds[p + 1])) for p in range(parts)]

    def repeat_interleave(self, times: int) -> "Batch":
        """Each sample ``times`` times in a row (a prompt's n responses)."""
        return self.select([i for i in range(len(self)) for _ in range(times)])

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Samples of every batch in order; tensors padded on the right to a common length when needed."""
        batches = [b for b in batches if len(b)]
        if not batches:
            return Batch()
        first = batches[0]
        out = Batch(meta={k: [x for b in batches for x in b.meta[k]] for k in first.meta})
        for key in first.tensors:
            values = [b.tensors[key] for b in batches]
            dim = 0 if key in PACKED_PATCH_KEYS + PACKED_IMAGE_KEYS else Batch._sample_dim(key, values[0])
            out.tensors[key] = torch.cat(_pad_last(values, PAD_VALUES.get(key, 0)) if values[0].dim() > dim + 1
                                         else values, dim=dim)
        if first.image_counts is not None:
            out.image_counts = torch.cat([b.image_counts for b in batches])  # type: ignore[misc]
        return out

    def interleave_for_ranks(self, per_step: int, ranks: int) -> "Batch":
        """Reorder so each rank's contiguous share holds its slice of every optimizer step.

        Step s uses samples [s*per_step, (s+1)*per_step) whatever the number of
        ranks, so 1 rank and k ranks take the same optimizer steps on the same data.
        """
        steps, share = len(self) // per_step, per_step // ranks
        return self.select([s * per_step + r * share + i for r in range(ranks) for s in range(steps)
                            for i in range(share)])

    def union(self, other: "Batch") -> "Batch":
        """This batch with ``other``'s tensors and meta added (same samples)."""
        assert len(self) == len(other) or not len(other), (len(self), len(other))
        return Batch({**self.tensors, **other.tensors}, {**self.meta, **other.meta}, self.image_counts)


def _pad_last(values: list[torch.Tensor], fill: int = 0) -> list[torch.Tensor]:
    """Right-pad along the last dim to the longest (only masked positions are added)."""
    longest = max(v.shape[-1] for v in values)
    return [torch.nn.functional.pad(v, (0, longest - v.shape[-1]), value=fill) if v.shape[-1] < longest else v
            for v in values]
