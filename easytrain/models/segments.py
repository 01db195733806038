"""Attention by sequence boundaries: packed, prompt-shared and Ulysses passes without an S x S mask.

A padding-free micro batch is one row of several samples back to back; a prompt-shared row is a prompt
followed by its responses, each response seeing the prompt and its own earlier tokens. Expressed as one
attention call they need an S x S mask (transformers builds a block-diagonal one from the position ids for
``sdpa``): 8 rows of 4096 tokens is 1 GB of mask per micro batch on a GPU, and under sequence parallelism
every rank would build the whole sequence's. Here the layout is a list of :class:`Block` per row instead: a
block's ``prefix`` (a sample, or a prompt) attends causally to itself, and each of its ``parts`` (a response)
to the whole prefix and causally to itself. :func:`attend` runs one ``scaled_dot_product_attention`` per prefix
(``is_causal``) and per part (a lower-right causal bias over prefix + part), so SDPA's flash or
memory-efficient kernels run on a GPU and nothing of S x S is ever built.

:func:`apply_segment_attention` switches a model's language model to ``"easytrain_segments"`` in transformers'
attention interface (the workers do so on GPU with ``sdpa``: ``workers.base.build_sharded_model``): inside a
:func:`segments` context its attention follows the given layout and its mask function builds nothing; outside
(generation, padded passes) it is plain ``sdpa`` with transformers' mask.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn

ATTENTION = "easytrain_segments"


@dataclass(frozen=True)
class Block:
    prefix: tuple[int, int]
    """[start, end) of a sample or prompt: causal attention within it."""
    parts: tuple[tuple[int, int], ...] = ()
    """[start, end) of each response sharing the prefix: it sees the prefix and its own earlier tokens."""


Layout = list[list[Block]]
"""Per row of the batch, its blocks; together they cover every column of the row in order."""
_active: list[Optional[Layout]] = [None]


@contextmanager
def segments(layout: Layout) -> Iterator[None]:
    """Attention of the forward run inside follows ``layout`` (models switched by :func:`apply_segment_attention`)."""
    previous, _active[0] = _active[0], layout
    try:
        yield
    finally:
        _active[0] = previous


def active() -> Optional[Layout]:
    return _active[0]


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
           scaling: Optional[float] = None) -> torch.Tensor:
    """Attention (B, H, S, D) of ``layout``'s blocks, one SDPA call per prefix and per part."""
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


def apply_segment_attention(model: nn.Module) -> nn.Module:
    """Switch ``model``'s language model (not its vision tower) to :func:`segment_attention` (in place)."""
    register()
    config = getattr(model, "config")
    text = getattr(config, "text_config", None) or config
    text._attn_implementation = ATTENTION  # noqa: SLF001 - transformers' own switch
    return model


def uses_segments(model: nn.Module) -> bool:
    config = getattr(model, "config")
    text = getattr(config, "text_config", None) or config
    return getattr(text, "_attn_implementation", None) == ATTENTION
