"""Attention by sequence boundaries: packed, prompt-shared and Ulysses passes without an S x S mask.

A padding-free micro batch is one row of several samples back to back; a prompt-shared row is a prompt
followed by its responses, each response seeing the prompt and its own earlier tokens. Expressed as one
attention call they need an S x S mask (transformers builds a block-diagonal one from the position ids for
``sdpa``): 8 rows of 4096 tokens is 1 GB of mask per micro batch on a GPU, and under sequence parallelism
every rank would build the whole sequence's. Here the layout is a list of :class:`Block` per row instead: a
block's ``prefix`` (a sample, or a prompt) attends causally to itself, and each of its ``parts`` (a response)
to the whole prefix and causally to itself. :func:`attend` runs the layout in one call of a variable-length
kernel where one fits (CUDA, fp16/bf16: PyTorch's ``varlen_attn``, or flash-attn's when the run asks for it;
:mod:`easytrain.models.varlen`), each block and part one sequence given by its boundaries; elsewhere one
``scaled_dot_product_attention`` per prefix (``is_causal``) and per part (a lower-right causal bias over
prefix + part). Either way nothing of S x S is ever built.

:func:`apply_segment_attention` switches a model's language model to ``"easytrain_segments"`` in transformers'
attention interface (the workers do so on GPU with ``sdpa``: ``workers.base.build_sharded_model``): inside a
:func:`segments` context its attention follows the given layout and its mask function builds nothing; outside
(generation, padded passes) it is plain ``sdpa`` with transformers' mask. Under gradient checkpointing the
layers recompute in backward, after the :func:`segments` context has closed: :func:`checkpoint_contexts`, given to
``torch.utils.checkpoint`` as its ``context_fn``, restores the forward's layout for the recomputation.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from easytrain.models.varlen import (PREFERENCES, SDPA_BLOCKS, Block, Layout, VarlenPlan, kernel_for,  # noqa: F401
                                     plan_layout, varlen_attention)

logger = logging.getLogger(__name__)

ATTENTION = "easytrain_segments"


@dataclass
class _Scope:
    """One :func:`segments` context: its layout, and that layout's kernel arguments per (row length, device),
    built once for all the layers of a forward (and its recomputation)."""

    layout: Layout
    plans: dict[tuple[int, str], VarlenPlan] = field(default_factory=dict)


_active: list[Optional[_Scope]] = [None]
_kernel: list[str] = ["auto"]
"""What :func:`apply_segment_attention` asked for (process-wide: every model of a worker shares the config)."""
_used: dict[str, str] = {}
"""Kernel -> where it first ran (dtype, device), logged once each."""


@contextmanager
def _entered(scope: Optional[_Scope]) -> Iterator[None]:
    previous, _active[0] = _active[0], scope
    try:
        yield
    finally:
        _active[0] = previous


def segments(layout: Layout) -> AbstractContextManager[None]:
    """Attention of the forward run inside follows ``layout`` (models switched by :func:`apply_segment_attention`)."""
    return _entered(_Scope(layout))


def active() -> Optional[Layout]:
    scope = _active[0]
    return None if scope is None else scope.layout


def checkpoint_contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant): nothing around the forward, and around the
    recomputation in backward the layout that was active in the forward (or none, if none was), with its kernel
    arguments. Without it a checkpointed layer recomputes packed attention as one causal sequence."""
    return nullcontext(), _entered(_active[0])


def used_kernels() -> dict[str, str]:
    """The attention kernels layouts ran with in this process, each with the dtype and device it first ran on."""
    return dict(_used)


def packed_blocks(text_positions: torch.Tensor) -> Layout:
    """One row of packed samples, from its text positions (S,): a position that does not follow its predecessor
    starts a sample."""
    text = text_positions.reshape(-1)
    starts = [0] + (torch.nonzero(text[1:] != text[:-1] + 1).reshape(-1) + 1).tolist() + [text.shape[0]]
    return [[Block((a, b)) for a, b in zip(starts, starts[1:]) if b > a]]


def shared_blocks(segment: torch.Tensor, unit: torch.Tensor, prompt: torch.Tensor) -> Layout:
    """Prompt-shared rows from each column's segment, unit (-1: padding) and whether it is prompt, all (rows, L):
    a unit's prompt segment is the prefix, its other segments the parts; a padding run is a block of its own
    (its outputs are never read)."""
    layout = []
    for seg_row, unit_row, prompt_row in zip(segment.tolist(), unit.tolist(), prompt.tolist()):
        runs: list[list[Any]] = []  # [start, end, segment, unit, is_prompt] of each run of one segment
        for column, key in enumerate(zip(seg_row, unit_row, prompt_row)):
            if runs and tuple(runs[-1][2:]) == (key[0], key[1], bool(key[2])):
                runs[-1][1] = column + 1
            else:
                runs.append([column, column + 1, key[0], key[1], bool(key[2])])
        blocks: list[Block] = []
        open_unit = None  # the unit whose prompt is the last block's prefix
        for start, end, _, u, is_prompt in runs:
            if u >= 0 and not is_prompt and u == open_unit:
                blocks[-1] = Block(blocks[-1].prefix, blocks[-1].parts + ((start, end),))
            else:
                blocks.append(Block((start, end)))
                open_unit = u if u >= 0 and is_prompt else None
        layout.append(blocks)
    return layout


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Layout,
           scaling: Optional[float] = None, kernel: Optional[str] = None) -> torch.Tensor:
    """Attention (B, H, S, D) of ``layout``'s blocks: one variable-length kernel call where one fits, else one SDPA
    call per prefix and per part. ``kernel``: one of :data:`easytrain.models.varlen.KERNELS` (tests), else chosen
    for the query's device and dtype (:func:`easytrain.models.varlen.choose_kernel`)."""
    if kernel is None:
        kernel = kernel_for(query, _kernel[0])
        if kernel not in _used:
            _used[kernel] = f"{str(query.dtype).removeprefix('torch.')} on {query.device.type}"
            logger.info("attention of packed and prompt-shared sequences: %s (%s, head dim %d; asked for %s)",
                        kernel, _used[kernel], query.shape[-1], _kernel[0])
    if kernel != SDPA_BLOCKS:
        return _attend_varlen(query, key, value, layout, scaling, kernel)
    return _attend_blocks(query, key, value, layout, scaling)


def _plan(layout: Layout, length: int, device: torch.device) -> VarlenPlan:
    """The layout's kernel arguments on ``device``, cached for the active layout (every layer reuses them)."""
    scope = _active[0]
    cache = scope.plans if scope is not None and scope.layout is layout else None
    key = (length, str(device))
    if cache is not None and key in cache:
        return cache[key]
    plan = plan_layout(layout, length).to(device)
    if cache is not None:
        cache[key] = plan
    return plan


def _attend_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Layout,
                   scaling: Optional[float], kernel: str) -> torch.Tensor:
    rows, heads, length, dim = query.shape
    if len(layout) != rows:
        raise ValueError(f"a layout of {len(layout)} rows for {rows} rows of queries")
    plan = _plan(layout, length, query.device)
    # (B, H, S, D) -> (B * S, H, D): a view when the projections were (B, S, H, D) transposed, as in transformers
    q, k, v = (t.transpose(1, 2).reshape(rows * length, t.shape[1], dim) for t in (query, key, value))
    out = varlen_attention(q, k, v, plan, scaling, kernel)
    return out.view(rows, length, heads, dim).transpose(1, 2)


def _attend_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Layout,
                   scaling: Optional[float]) -> torch.Tensor:
    """One SDPA call per prefix and per part (any device and dtype)."""
    from torch.nn.attention.bias import causal_lower_right

    sdpa = nn.functional.scaled_dot_product_attention
    gqa = key.shape[1] != query.shape[1]
    rows = []
    for b, blocks in enumerate(layout):
        q_row, k_row, v_row = query[b:b + 1], key[b:b + 1], value[b:b + 1]
        pieces: list[tuple[int, torch.Tensor]] = []
        for block in blocks:
            a, e = block.prefix
            k_pre, v_pre = k_row[:, :, a:e], v_row[:, :, a:e]
            pieces.append((a, sdpa(q_row[:, :, a:e], k_pre, v_pre, is_causal=True, scale=scaling, enable_gqa=gqa)))
            for c, d in block.parts:
                k = torch.cat([k_pre, k_row[:, :, c:d]], dim=2)
                v = torch.cat([v_pre, v_row[:, :, c:d]], dim=2)
                bias = causal_lower_right(d - c, (e - a) + (d - c))
                pieces.append((c, sdpa(q_row[:, :, c:d], k, v, attn_mask=bias, scale=scaling, enable_gqa=gqa)))
        pieces.sort(key=lambda piece: piece[0])
        covered = sum(p.shape[2] for _, p in pieces)
        if covered != query.shape[2]:
            raise ValueError(f"the attention layout covers {covered} of the row's {query.shape[2]} positions")
        rows.append(torch.cat([p for _, p in pieces], dim=2))
    return torch.cat(rows, dim=0)


def segment_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: the active layout's attention, else plain sdpa."""
    layout = active()
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return attend(query, key, value, layout, scaling).transpose(1, 2).contiguous(), None


def mask_outside_layouts(*args: Any, **kwargs: Any) -> Any:
    """No mask inside a layout (the blocks are the mask); transformers' sdpa mask outside."""
    if active() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, segment_attention)
    AttentionMaskInterface.register(ATTENTION, mask_outside_layouts)


def apply_segment_attention(model: nn.Module, kernel: str = "auto") -> nn.Module:
    """Switch ``model``'s language model (not its vision tower) to :func:`segment_attention` (in place).
    ``kernel``: the variable-length kernel layouts may use where one fits (``varlen.PREFERENCES``: ``auto``,
    ``flash_attn`` for a run that chose flash_attention_2, ``sdpa_blocks`` to keep the block-by-block path,
    ``reference`` for tests)."""
    if kernel not in PREFERENCES:
        raise ValueError(f"segment attention kernel {kernel!r}: choose one of {', '.join(PREFERENCES)}")
    _kernel[0] = kernel
    register()
    config = getattr(model, "config")
    text = getattr(config, "text_config", None) or config
    text._attn_implementation = ATTENTION  # noqa: SLF001 - transformers' own switch
    return model


def uses_segments(model: nn.Module) -> bool:
    config = getattr(model, "config")
    text = getattr(config, "text_config", None) or config
    return getattr(text, "_attn_implementation", None) == ATTENTION
