"""The batch that travels between the driver and worker groups.

Most tensors have one row per sample. Images are packed: ``pixel_values``
holds the patch rows of every image back to back and ``image_grid_thw`` one
row per image, so splitting or selecting samples must carry the right image
and patch ranges along; :class:`Batch` does that, so dispatch code and
workers never re-derive it. Videos travel in the same stream
(``visual_seconds`` tells them apart), so ``image_counts`` counts a sample's
images and videos. Python lists (uids, answers, PIL images for
vLLM) ride in ``meta``, one entry per sample. A :class:`MicroBatch` is one
forward's samples as the driver planned them, with how to run them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

PACKED_PATCH_KEYS = ("pixel_values",)
PACKED_IMAGE_KEYS = ("image_grid_thw", "visual_seconds")
"""Per-visual tensors (a row per image or video: :mod:`easytrain.data.vision`'s stream)."""
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
        return 1 if key == "position_ids" and value.dim() == 3 else 0  # multimodal rope rows: (3, batch, length)

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
            images = _ranges(_offsets(self.image_counts), index)
            for key in PACKED_IMAGE_KEYS:
                if key in self.tensors:
                    out.tensors[key] = self.tensors[key].index_select(0, images)
            if any(key in self.tensors for key in PACKED_PATCH_KEYS):
                patches = _ranges(_offsets(self.tensors["image_grid_thw"].prod(-1)), images)
                for key in PACKED_PATCH_KEYS:
                    if key in self.tensors:
                        out.tensors[key] = self.tensors[key].index_select(0, patches)
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
        batches = [_with_seconds(b) if any("visual_seconds" in o.tensors for o in batches) else b
                   for b in batches if len(b)]
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

    def __getstate__(self) -> dict[str, Any]:
        """What pickling (and so every Ray call and result) carries. A sample whose images equal the previous
        sample's (a prompt's n rows) sends none of its own; :meth:`__setstate__` copies them back. CPU tensors
        travel as numpy arrays, which Ray serialises out of band (no copy into the pickle stream; a torch
        tensor is pickled byte by byte: ~4x slower per call for a rollout batch here)."""
        state = dict(self.__dict__)
        tensors = self.tensors
        owners = self._repeated_image_owners()
        if owners is not None:
            kept = sorted(set(owners))
            compact = self._images_only().select(kept)
            tensors = {**self.tensors, **compact.tensors}
            position = {owner: k for k, owner in enumerate(kept)}
            state["_image_rows"] = [position[o] for o in owners]
            state["_compact_counts"] = compact.image_counts
        state["tensors"] = {k: _to_wire(v) for k, v in tensors.items()}
        return state

    def _images_only(self) -> "Batch":
        return Batch({k: v for k, v in self.tensors.items() if k in PACKED_PATCH_KEYS + PACKED_IMAGE_KEYS},
                     image_counts=self.image_counts)

    def __setstate__(self, state: dict[str, Any]) -> None:
        rows = state.pop("_image_rows", None)
        compact_counts = state.pop("_compact_counts", None)
        state["tensors"] = {k: _from_wire(v) for k, v in state["tensors"].items()}
        self.__dict__.update(state)
        if rows is not None:
            full = Batch(self._images_only().tensors, image_counts=compact_counts).select(rows)
            self.tensors.update(full.tensors)

    def _repeated_image_owners(self) -> Optional[list[int]]:
        """For each sample, the first of the run of consecutive samples with equal images it belongs to; None when
        no sample repeats its predecessor's images (nothing to save)."""
        if (self.image_counts is None or "pixel_values" not in self.tensors or "image_grid_thw" not in self.tensors
                or len(self) < 2):
            return None
        image_offsets, patch_offsets = self._image_ranges()
        grids, pixels = self.tensors["image_grid_thw"], self.tensors["pixel_values"]

        def images(i: int) -> tuple[int, int]:
            return image_offsets[i], image_offsets[i + 1]

        owners = [0]
        for i in range(1, len(self)):
            (a0, a1), (b0, b1) = images(i - 1), images(i)
            seconds = self.tensors.get("visual_seconds")
            same = (a1 - a0 == b1 - b0 > 0 and torch.equal(grids[a0:a1], grids[b0:b1])
                    and (seconds is None or torch.equal(seconds[a0:a1], seconds[b0:b1]))
                    and torch.equal(pixels[patch_offsets[a0]:patch_offsets[a1]],
                                    pixels[patch_offsets[b0]:patch_offsets[b1]]))
            owners.append(owners[-1] if same else i)
        return owners if len(set(owners)) < len(owners) else None

    def union(self, other: "Batch") -> "Batch":
        """This batch with ``other``'s tensors and meta added (same samples)."""
        assert len(self) == len(other) or not len(other), (len(self), len(other))
        return Batch({**self.tensors, **other.tensors}, {**self.meta, **other.meta}, self.image_counts)


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """Where each of ``counts``' runs starts, and (last) their total: ``[0, c0, c0 + c1, ...]``."""
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts.long(), 0)])


def _ranges(offsets: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
    """The indices of runs ``which`` (runs ``i`` spanning ``[offsets[i], offsets[i + 1])``), back to back in that
    order: one vectorised gather index, where a Python list of every patch row cost a rollout batch's selects
    most of their time."""
    starts, counts = offsets[which], offsets[which + 1] - offsets[which]
    total = int(counts.sum())
    placed = torch.cumsum(counts, 0) - counts  # where each run begins in the output
    return torch.repeat_interleave(starts - placed, counts, output_size=total) + torch.arange(total)


def _with_seconds(batch: Batch) -> Batch:
    """``batch`` with ``visual_seconds`` for each of its visuals (0: the still images a multi-turn tool turn returns,
    which are built without it), so it joins batches that carry it."""
    if "visual_seconds" in batch.tensors or "image_grid_thw" not in batch.tensors:
        return batch
    seconds = torch.zeros(batch.tensors["image_grid_thw"].shape[0], dtype=torch.float32)
    return Batch({**batch.tensors, "visual_seconds": seconds}, batch.meta, batch.image_counts)


def _to_wire(tensor: torch.Tensor) -> Any:
    """A CPU tensor as (numpy array, torch dtype); dtypes numpy lacks (bfloat16) as same-width integers."""
    if tensor.device.type != "cpu" or tensor.requires_grad:
        return tensor
    dtype = tensor.dtype
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    try:
        return _Wire(tensor.numpy(), str(dtype).removeprefix("torch."))
    except (TypeError, RuntimeError):  # a dtype or layout numpy lacks (float8, sparse): torch pickles it
        return tensor


def _from_wire(value: Any) -> torch.Tensor:
    if not isinstance(value, _Wire):
        return value
    array = value.array if value.array.flags.writeable else value.array.copy()  # Ray hands out read-only views
    tensor = torch.from_numpy(array)
    dtype = getattr(torch, value.dtype)
    return tensor.view(dtype) if tensor.dtype != dtype else tensor


@dataclass
class _Wire:
    """A tensor in transit: its numpy array and its torch dtype's name."""

    array: Any
    dtype: str


def _pad_last(values: list[torch.Tensor], fill: int = 0) -> list[torch.Tensor]:
    """Right-pad along the last dim to the longest (only masked positions are added)."""
    longest = max(v.shape[-1] for v in values)
    return [torch.nn.functional.pad(v, (0, longest - v.shape[-1]), value=fill) if v.shape[-1] < longest else v
            for v in values]


@dataclass
class MicroBatch:
    """One forward pass's samples and how the worker runs them, both decided by the driver's plan
    (:mod:`easytrain.trainer.micro_batches`); the worker follows it."""

    batch: Batch
    packed: bool = False
    """Padding-free: the samples run as one flattened sequence of exactly their tokens; else padded rows."""
    prompt_groups: Optional[list[list[int]]] = None
    """Samples that share a prompt, run prompt-once (:mod:`easytrain.workers.shared_prompt`); None: every
    sample runs on its own."""

    def __len__(self) -> int:
        return len(self.batch)
