"""Each distinct image through the vision tower once per forward (``model.dedupe_images``).

A GRPO batch holds every prompt ``n`` times (one row per sampled response),
and with it every image ``n`` times: the rollout's prefill, the reference and
the actor would run the vision tower ``n`` times over the same pixels. Hooks
on the tower (Qwen2-VL and Qwen2.5-VL: ``visual(pixel_values, grid_thw)``
returning the merged features as ``pooler_output``) find identical images
(same grid, equal pixels, verified with ``torch.equal``), run the tower on
the distinct ones only and hand every image its features by index: the same
values (each image is attended to on its own inside the tower, so batching
fewer of them changes nothing but rounding), and under autograd each copy's
gradient flows back into the one computation, summed as the copies' would
have been. ``last_hidden_state`` (patch level, unused by the language model)
is left as the tower returned it, for the distinct images only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass
class DedupStats:
    """Images seen and run by the tower since the hooks were installed (for benches and tests)."""

    images: int = 0
    computed: int = 0
    calls: list[tuple[int, int]] = field(default_factory=list)


def distinct_images(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[list[int], list[int]]:
    """(index of the first copy of every distinct image, for every image the position of its copy in that list)."""
    sizes = grid_thw.prod(-1).tolist()
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + int(size))
    firsts: list[int] = []
    owner: list[int] = []
    by_key: dict[tuple[Any, ...], list[int]] = {}
    for i, size in enumerate(sizes):
        block = pixel_values[starts[i]:starts[i + 1]]
        key = (tuple(grid_thw[i].tolist()), float(block.sum()), float(block.abs().sum()))
        for slot in by_key.get(key, []):
            j = firsts[slot]
            if torch.equal(block, pixel_values[starts[j]:starts[j + 1]]):
                owner.append(slot)
                break
        else:
            by_key.setdefault(key, []).append(len(firsts))
            owner.append(len(firsts))
            firsts.append(i)
    return firsts, owner


def vision_tower(model: nn.Module) -> Optional[nn.Module]:
    """The ``visual`` module of a Qwen-VL model (through PEFT wrappers), or None for a text model."""
    inner: Any = model
    for _ in range(4):
        visual = getattr(getattr(inner, "model", None), "visual", None) or getattr(inner, "visual", None)
        if visual is not None:
            return visual
        inner = getattr(inner, "base_model", None) or getattr(inner, "model", None)
        if inner is None:
            return None
    return None


def dedupe_images(model: nn.Module) -> Optional[DedupStats]:
    """Install the hooks on ``model``'s vision tower (in place); returns their counters, None for a text model."""
    visual = vision_tower(model)
    if visual is None:
        return None
    stats = DedupStats()
    pending: list[tuple[torch.Tensor, int]] = []
    merge = int(getattr(visual, "spatial_merge_size", 2))

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[tuple[Any, Any]]:
        pixels = args[0] if args else kwargs["hidden_states"]
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        if grid is None or grid.shape[0] < 2:
            pending.append((torch.empty(0), 0))
            return None
        firsts, owner = distinct_images(pixels, grid)
        stats.images += grid.shape[0]
        stats.computed += len(firsts)
        stats.calls.append((grid.shape[0], len(firsts)))
        if len(firsts) == grid.shape[0]:
            pending.append((torch.empty(0), 0))
            return None
        sizes = grid.prod(-1)
        starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        rows = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in firsts]).to(pixels.device)
        merged = (sizes // merge**2).tolist()
        offsets = [0]
        for i in firsts:
            offsets.append(offsets[-1] + merged[i])
        index = torch.cat([torch.arange(offsets[slot], offsets[slot + 1]) for slot in owner])
        pending.append((index, len(firsts)))
        unique_grid = grid[firsts]
        if args:
            args = (pixels.index_select(0, rows), *args[1:])
            if len(args) > 1:
                args = (args[0], unique_grid, *args[2:])
        else:
            kwargs["hidden_states"] = pixels.index_select(0, rows)
        if "grid_thw" in kwargs:
            kwargs["grid_thw"] = unique_grid
        return args, kwargs

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        index, _ = pending.pop()
        if index.numel() == 0:
            return output
        output.pooler_output = output.pooler_output.index_select(0, index.to(output.pooler_output.device))
        return output

    visual.register_forward_pre_hook(before, with_kwargs=True)
    visual.register_forward_hook(after, with_kwargs=True)
    return stats
