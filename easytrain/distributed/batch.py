"""The batch that travels between the driver and worker groups.

Most tensors have one row per sample. Visuals are packed: ``image_grid_thw``
(and ``visual_seconds``) hold a row per image or video, back to back, and
``image_counts`` how many each sample has. Their patch rows are stored once
per distinct visual (:class:`Pixels`): a prompt repeated for its n responses
points its n copies at the same stored rows, so the driver holds, and each
Ray call sends, every prompt's pixels once. ``batch["pixel_values"]`` and
:meth:`Batch.expanded_tensors` build every visual's rows back to back, as a
forward takes them (a worker's micro batch, not a rollout batch, should ask).
Selecting, splitting and joining samples carries the right visuals and stored
rows along, so dispatch code and workers never re-derive them. Videos travel
in the same stream (``visual_seconds`` tells them apart). Python lists (uids,
answers, PIL images for vLLM) ride in ``meta``, one entry per sample. A
:class:`MicroBatch` is one forward's samples as the driver planned them, with
how to run them; :class:`MicroBatches` a worker's planned micro batches as one
call sends them (each prompt's pixels once, not once per micro batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch

PIXELS = "pixel_values"
"""Every visual's patch rows back to back, as a forward takes them; a :class:`Batch` stores them as :class:`Pixels`."""
PACKED_IMAGE_KEYS = ("image_grid_thw", "visual_seconds")
"""Per-visual tensors (a row per image or video: :mod:`easytrain.data.vision`'s stream)."""
PAD_VALUES = {"targets": -100}
"""What right padding holds per tensor when batches of different widths are joined (0 for the rest): SFT
targets are ignored there (the label index cross-entropy skips)."""


@dataclass
class Pixels:
    """A batch's patch rows with each distinct visual stored once: the stored blocks' rows back to back, and for
    every visual of the batch the block it shows. Repeating a sample repeats its block indices, not its rows."""

    blocks: torch.Tensor
    """The stored blocks' patch rows, back to back."""
    sizes: torch.Tensor
    """Patch rows of each stored block (long)."""
    index: torch.Tensor
    """For each visual of the batch, in stream order, the stored block it shows (long)."""

    @staticmethod
    def of(rows: torch.Tensor, sizes: torch.Tensor) -> "Pixels":
        """Per-visual patch rows (``sizes`` rows each, back to back) as a block per visual."""
        return Pixels(rows, sizes.long(), torch.arange(len(sizes)))

    def expand(self) -> torch.Tensor:
        """Every visual's patch rows back to back (a block shown k times, k times): the stored rows themselves when
        each block is shown once, in order."""
        if len(self.index) == len(self.sizes) and torch.equal(self.index, torch.arange(len(self.sizes))):
            return self.blocks
        return self.rows(torch.arange(len(self.index)))

    def rows(self, visuals: torch.Tensor) -> torch.Tensor:
        """The patch rows of the visuals at ``visuals``, back to back (a copy)."""
        return self.blocks.index_select(0, _ranges(_offsets(self.sizes), self.index[visuals]))

    def take(self, visuals: torch.Tensor) -> "Pixels":
        """The visuals at ``visuals`` (in that order; repeats share their block) with only the blocks they show: all
        blocks as they are, a run of blocks as a view, else a copy of the blocks used."""
        index = self.index[visuals]
        used, inverse = torch.unique(index, return_inverse=True)
        if len(used) == len(self.sizes):
            return Pixels(self.blocks, self.sizes, index)
        offsets = _offsets(self.sizes)
        if len(used) and int(used[-1] - used[0]) + 1 == len(used):
            first, last = int(used[0]), int(used[-1]) + 1
            return Pixels(self.blocks[int(offsets[first]):int(offsets[last])], self.sizes[first:last], index - first)
        return Pixels(self.blocks.index_select(0, _ranges(offsets, used)), self.sizes[used], inverse)

    @staticmethod
    def concat(parts: Sequence["Pixels"]) -> "Pixels":
        """The visuals of every part in order, each part's blocks stored after the previous part's."""
        if len(parts) == 1:
            return parts[0]
        starts = [0] + torch.cumsum(torch.tensor([len(p.sizes) for p in parts]), 0).tolist()
        return Pixels(torch.cat([p.blocks for p in parts]), torch.cat([p.sizes for p in parts]),
                      torch.cat([p.index + start for p, start in zip(parts, starts)]))

    def __getstate__(self) -> dict[str, Any]:
        """The stored rows as they are (a view sends its own rows only), as :meth:`Batch.__getstate__` sends tensors."""
        return {k: _to_wire(v) for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({k: _from_wire(v) for k, v in state.items()})


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors with a row per sample, and the per-visual :data:`PACKED_IMAGE_KEYS`. ``pixel_values`` given here
    (every visual's rows back to back) moves into :attr:`pixels`, a block per visual."""
    meta: dict[str, list[Any]] = field(default_factory=dict)
    image_counts: Optional[torch.Tensor] = None
    """Visuals per sample (needed to split packed visual tensors); None when there are no images."""
    pixels: Optional[Pixels] = None
    """The visuals' patch rows, each distinct visual stored once; None without images."""

    def __post_init__(self) -> None:
        if PIXELS in self.tensors:
            if self.pixels is not None or "image_grid_thw" not in self.tensors:
                raise ValueError("a Batch takes pixel_values with image_grid_thw (each visual's patch rows), and "
                                 "not beside pixels")
            self.tensors = dict(self.tensors)
            self.pixels = Pixels.of(self.tensors.pop(PIXELS), self.tensors["image_grid_thw"].prod(-1))
        elif "image_grid_thw" in self.tensors and self.pixels is None:
            raise ValueError("a Batch with image_grid_thw needs its patch rows: pass pixels=batch.pixels (a batch "
                             "built from another's tensors does not carry them)")

    def __len__(self) -> int:
        for key, value in self.tensors.items():
            if key not in PACKED_IMAGE_KEYS:
                return int(value.shape[self._sample_dim(key, value)])
        for value in self.meta.values():
            return len(value)
        return 0

    @staticmethod
    def _sample_dim(key: str, value: torch.Tensor) -> int:
        return 1 if key == "position_ids" and value.dim() == 3 else 0  # multimodal rope rows: (3, batch, length)

    def __getitem__(self, key: str) -> torch.Tensor:
        """A tensor by name; ``pixel_values``: every visual's patch rows, built from the stored blocks."""
        if key == PIXELS and self.pixels is not None:
            return self.pixels.expand()
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or (key == PIXELS and self.pixels is not None)

    def expanded_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, ``pixel_values`` included (every visual's rows back to back): what a forward and the
        model family's adapter take."""
        return {**self.tensors, PIXELS: self.pixels.expand()} if self.pixels is not None else dict(self.tensors)

    def _visuals(self, sample: int) -> torch.Tensor:
        assert self.image_counts is not None
        offsets = _offsets(self.image_counts)
        return torch.arange(int(offsets[sample]), int(offsets[sample + 1]))

    def same_pixels(self, a: int, b: int) -> bool:
        """Whether samples ``a`` and ``b`` have equal patch rows: at once when they show the same stored blocks,
        else compared value by value."""
        if self.pixels is None:
            return True
        first, second = self._visuals(a), self._visuals(b)
        return (torch.equal(self.pixels.index[first], self.pixels.index[second])
                or torch.equal(self.pixels.rows(first), self.pixels.rows(second)))

    def shown_blocks(self) -> list[tuple[int, ...]]:
        """Per sample, the stored blocks its visuals show (samples showing the same ones have equal pixels)."""
        if self.pixels is None or self.image_counts is None:
            return [()] * len(self)
        shown, counts = self.pixels.index.tolist(), _offsets(self.image_counts).tolist()
        return [tuple(shown[a:b]) for a, b in zip(counts, counts[1:])]

    def pixel_keys(self) -> list[tuple[tuple[Any, ...], ...]]:
        """Per sample, each visual's grid, patch-row count and the integer sum of its values' bit patterns: samples
        whose visuals have equal grids and equal pixels have equal keys (an integer sum does not depend on the order
        it is taken in), so only those need :meth:`same_pixels`' comparison; equal rows on another grid (a
        transposed image of one colour) take other positions and differ here. () for every sample without images."""
        if self.pixels is None or self.image_counts is None:
            return [()] * len(self)
        pixels, bits = self.pixels, {2: torch.int16, 4: torch.int32, 8: torch.int64}
        rows = pixels.blocks.flatten(1) + 0.0  # a row per patch row (or tile); + 0.0: -0.0 counts as 0.0
        row_sums = rows.view(bits[rows.element_size()]).sum(-1, dtype=torch.int64)
        owner = torch.repeat_interleave(torch.arange(len(pixels.sizes)), pixels.sizes, output_size=len(rows))
        sums = torch.zeros(len(pixels.sizes), dtype=torch.int64).index_add_(0, owner, row_sums).tolist()
        fingerprint = list(zip(pixels.sizes.tolist(), sums))
        grids = [tuple(g) for g in self.tensors["image_grid_thw"].tolist()]
        shown, counts = pixels.index.tolist(), _offsets(self.image_counts).tolist()
        return [tuple((grids[v], *fingerprint[shown[v]]) for v in range(a, b)) for a, b in zip(counts, counts[1:])]

    def select(self, indices: Sequence[int]) -> "Batch":
        """The samples at ``indices`` (in that order), with their visuals; repeated samples share stored rows, and
        only the rows the selected samples show are kept."""
        index = torch.as_tensor(list(indices), dtype=torch.long)
        out = Batch(meta={k: [v[i] for i in indices] for k, v in self.meta.items()})
        for key, value in self.tensors.items():
            if key not in PACKED_IMAGE_KEYS:
                out.tensors[key] = value.index_select(self._sample_dim(key, value), index)
        if self.image_counts is not None:
            out.image_counts = self.image_counts[index]
            visuals = _ranges(_offsets(self.image_counts), index)
            for key in PACKED_IMAGE_KEYS:
                if key in self.tensors:
                    out.tensors[key] = self.tensors[key].index_select(0, visuals)
            if self.pixels is not None:
                out.pixels = self.pixels.take(visuals)
        return out

    def split(self, parts: int) -> list["Batch"]:
        """``parts`` contiguous chunks whose sizes differ by at most one."""
        n = len(self)
        bounds = [n * p // parts for p in range(parts + 1)]
        return [self.select(range(bounds[p], bounds[p + 1])) for p in range(parts)]

    def repeat_interleave(self, times: int) -> "Batch":
        """Each sample ``times`` times in a row (a prompt's n responses), its stored rows shared, not copied."""
        return self.select([i for i in range(len(self)) for _ in range(times)])

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Samples of every batch in order; tensors padded on the right to a common length when needed."""
        batches = [b for b in batches if len(b)]
        like = next((b for b in batches if b.pixels is not None), None)
        if like is not None:  # a batch without visuals joins with none (text prompts beside tool images)
            batches = [b if b.pixels is not None else _without_any(b, like) for b in batches]
        batches = [_with_seconds(b) if any("visual_seconds" in o.tensors for o in batches) else b for b in batches]
        if not batches:
            return Batch()
        first = batches[0]
        out = Batch(meta={k: [x for b in batches for x in b.meta[k]] for k in first.meta})
        for key in first.tensors:
            values = [b.tensors[key] for b in batches]
            dim = 0 if key in PACKED_IMAGE_KEYS else Batch._sample_dim(key, values[0])
            out.tensors[key] = torch.cat(_pad_last(values, PAD_VALUES.get(key, 0)) if values[0].dim() > dim + 1
                                         else values, dim=dim)
        if first.image_counts is not None:
            out.image_counts = torch.cat([b.image_counts for b in batches])  # type: ignore[misc]
        if first.pixels is not None:
            out.pixels = Pixels.concat([b.pixels for b in batches])  # type: ignore[misc]
        return out

    def __getstate__(self) -> dict[str, Any]:
        """What pickling (and so every Ray call and result) carries: the batch as it is held, stored rows once
        (:class:`Pixels`). CPU tensors travel as numpy arrays, which Ray serialises out of band (no copy into the
        pickle stream; a torch tensor is pickled byte by byte: ~4x slower per call for a rollout batch here)."""
        state = dict(self.__dict__)
        state["tensors"] = {k: _to_wire(v) for k, v in self.tensors.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["tensors"] = {k: _from_wire(v) for k, v in state["tensors"].items()}
        self.__dict__.update(state)

    def without_visuals(self) -> "Batch":
        """This batch's per-sample tensors and meta, without its visuals (pixels, per-visual rows, counts): what a
        result sends back to a caller that already holds them (see :meth:`with_visuals_of`)."""
        return Batch({k: v for k, v in self.tensors.items() if k not in PACKED_IMAGE_KEYS}, self.meta)

    def with_visuals_of(self, other: "Batch") -> "Batch":
        """This batch with the visuals of ``other``, which holds the same samples in the same order (its stored
        rows shared, not copied); this batch's own per-sample tensors are kept."""
        if len(self) != len(other):
            raise ValueError(f"visuals of {len(other)} samples cannot join a batch of {len(self)}")
        visuals = {k: v for k, v in other.tensors.items() if k in PACKED_IMAGE_KEYS}
        return Batch({**self.tensors, **visuals}, self.meta, other.image_counts, other.pixels)

    def union(self, other: "Batch") -> "Batch":
        """This batch with ``other``'s tensors and meta added (same samples)."""
        assert len(self) == len(other) or not len(other), (len(self), len(other))
        return Batch({**self.tensors, **other.tensors}, {**self.meta, **other.meta}, self.image_counts,
                     self.pixels if self.pixels is not None else other.pixels)


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


def _without_any(batch: Batch, like: Batch) -> Batch:
    """``batch``, which has no visuals, with none in ``like``'s layout (zero counts, empty grids and rows), so it
    joins batches that have some."""
    empty = {k: like.tensors[k][:0] for k in PACKED_IMAGE_KEYS if k in like.tensors}
    none = torch.zeros(0, dtype=torch.long)
    return Batch({**batch.tensors, **empty}, batch.meta, torch.zeros(len(batch), dtype=torch.long),
                 Pixels(like.pixels.blocks[:0], none, none.clone()))  # type: ignore[union-attr]


def _with_seconds(batch: Batch) -> Batch:
    """``batch`` with ``visual_seconds`` for each of its visuals (0: the still images a multi-turn tool turn returns,
    which are built without it), so it joins batches that carry it."""
    if "visual_seconds" in batch.tensors or "image_grid_thw" not in batch.tensors:
        return batch
    seconds = torch.zeros(batch.tensors["image_grid_thw"].shape[0], dtype=torch.float32)
    return Batch({**batch.tensors, "visual_seconds": seconds}, batch.meta, batch.image_counts, batch.pixels)


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


@dataclass
class MicroBatches(Sequence[MicroBatch]):
    """One member's planned micro batches as a call sends them: the samples they run, once and in micro-batch
    order (so each prompt's visuals travel once, however many micro batches show them), and where each micro
    batch's samples sit among them. Reading a micro batch cuts it out then (its rows a view where its visuals are
    stored back to back), so a worker holds the member's pixels once plus the micro batch it runs. Sent as a
    list of micro batches, a prompt's n samples in micro batches of one carried n copies of its pixels through
    the object store and into the worker."""

    batch: Batch
    bounds: list[int]
    """Micro batch k runs samples ``[bounds[k], bounds[k + 1])`` of :attr:`batch`."""
    packed: bool = False
    prompt_groups: list[Optional[list[list[int]]]] = field(default_factory=list)
    """Each micro batch's :attr:`MicroBatch.prompt_groups` (empty: none shares)."""

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, k: int) -> MicroBatch:  # type: ignore[override]
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        k %= len(self)
        groups = self.prompt_groups[k] if self.prompt_groups else None
        return MicroBatch(self.batch.select(range(self.bounds[k], self.bounds[k + 1])), self.packed, groups)

    def __iter__(self) -> Iterator[MicroBatch]:
        return (self[k] for k in range(len(self)))
