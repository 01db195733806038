"""Each distinct image through the vision tower once per forward (``model.dedupe_images``).

A GRPO batch holds every prompt ``n`` times (one row per sampled response),
and with it every image ``n`` times: the rollout's prefill, the reference and
the actor would run the vision tower ``n`` times over the same pixels. Hooks
on the tower (:func:`dedupe_patch_rows` for a tower that takes every
image's patch rows and grid, :func:`dedupe_batched` for one that takes a
batch of tiles; the family's adapter picks) find identical images
(same grid, equal pixels, verified with ``torch.equal``), run the tower on
the distinct ones only and hand every image its features by index: the same
values (each image is attended to on its own inside the tower, so batching
fewer of them changes nothing but rounding), and under autograd each copy's
gradient flows back into the one computation, summed as the copies' would
have been. ``last_hidden_state`` (patch level, unused by the language model)
is left as the tower returned it, for the distinct images only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn


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


def dedupe_patch_rows(visual: nn.Module, merge: int) -> DedupStats:
    """Hooks for a tower called ``visual(pixel_rows, grid_thw)`` that returns every image's merged features back
    to back as ``pooler_output`` (and, where the tower has them, per-layer ``deepstack_features`` alike)."""
    stats = DedupStats()
    pending: list[tuple[torch.Tensor, int]] = []

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
        deepstack = getattr(output, "deepstack_features", None)
        if deepstack:
            output.deepstack_features = [f.index_select(0, index.to(f.device)) for f in deepstack]
        return output

    visual.register_forward_pre_hook(before, with_kwargs=True)
    visual.register_forward_hook(after, with_kwargs=True)
    return stats


def dedupe_batched(tower: nn.Module) -> DedupStats:
    """Hooks for a tower called on a batch of equal-sized images or tiles, ``tower(pixel_values=(N, C, H, W))``,
    each attended to on its own (tile and fixed-image towers): the distinct ones run, and every output with a batch
    dimension (``last_hidden_state``, ``pooler_output``, ``hidden_states``) is handed back per input."""
    stats = DedupStats()
    pending: list[Optional[torch.Tensor]] = []

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[tuple[Any, Any]]:
        pixels = args[0] if args else kwargs.get("pixel_values")
        if pixels is None or pixels.shape[0] < 2:
            pending.append(None)
            return None
        flat = pixels.reshape(pixels.shape[0], -1)
        firsts, owner = distinct_images(flat, torch.ones(pixels.shape[0], 3, dtype=torch.long))
        stats.images += pixels.shape[0]
        stats.computed += len(firsts)
        stats.calls.append((pixels.shape[0], len(firsts)))
        if len(firsts) == pixels.shape[0]:
            pending.append(None)
            return None
        pending.append(torch.tensor(owner))
        unique = pixels.index_select(0, torch.tensor(firsts, device=pixels.device))
        if args:
            return (unique, *args[1:]), kwargs
        kwargs["pixel_values"] = unique
        return args, kwargs

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        index = pending.pop()
        if index is None:
            return output
        for name in ("last_hidden_state", "pooler_output"):
            value = getattr(output, name, None)
            if isinstance(value, torch.Tensor):
                setattr(output, name, value.index_select(0, index.to(value.device)))
        states = getattr(output, "hidden_states", None)
        if states is not None:
            output.hidden_states = tuple(h.index_select(0, index.to(h.device)) for h in states)
        return output

    tower.register_forward_pre_hook(before, with_kwargs=True)
    tower.register_forward_hook(after, with_kwargs=True)
    return stats
