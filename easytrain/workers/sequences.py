"""Prompt + response sequences, as every training-side forward pass takes them."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from easytrain.data.collate import text_positions
from easytrain.data.vision import VISUAL_KEYS
from easytrain.distributed.batch import PACKED_IMAGE_KEYS, Batch
from easytrain.models.families import Family


def continue_after_prompt(positions: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> None:
    """Give each row's response tokens (columns from ``prompt_width``) the positions generation gave them, in place:
    one past the prompt's largest position, then one more per token. After text or an image that is where the
    text would go on anyway; a video's time-scaled temporal positions can reach past it (a long clip, or few
    tokens after one), and the engine continued from there (a multimodal rotary offset is the prompt's maximum + 1)."""
    start = positions[:, :, :prompt_width].amax(dim=(0, 2)) + 1
    present = attention_mask[:, prompt_width:]
    steps = (present.cumsum(-1) - 1).clamp(min=0)
    positions[:, :, prompt_width:] = ((start[:, None] + steps) * present)[None]


def continued_positions(family: Family, batch: Batch) -> torch.Tensor:
    """Multimodal rotary positions of a partial rollout's continuation rows (each one's prompt and its response
    so far, left-padded; ``continued`` holds the response's length per row): the prompt's as the family places
    them, and the response going on from the prompt's largest position + 1, where the decode that sampled it
    placed it (:func:`continue_after_prompt`). The model's own rule would put that text after the prompt's last
    token instead, which differs after a video whose temporal positions reach past the text."""
    mask = batch["attention_mask"]
    positions = family.positions(batch["input_ids"], batch.tensors.get("mm_token_type_ids"), batch.tensors, mask)
    width = mask.shape[1]
    for row, k in enumerate(batch["continued"].tolist()):
        if k:
            start = positions[:, row, :width - k].max() + 1
            positions[:, row, width - k:] = start + torch.arange(k)
    return positions


def assemble(prompts: Batch, generated: Batch, n: int, family: Optional[Family] = None) -> Batch:
    """Join each prompt (repeated ``n`` times) with its responses: ids, masks, positions, image tensors.

    Prompts are left-padded and responses right-padded, so every response
    starts at the same column. Position ids are the model ``family``'s (its
    adapter's: multimodal rotary rows, or 1-D) when the prompts carry
    ``mm_token_type_ids``, else 1-D positions. A
    multi-turn response attends to every token it holds
    (``response_attention_mask``: tool turns too), while ``response_mask``
    marks the model's own, which are trained.
    """
    rows = prompts.repeat_interleave(n)
    prompt_ids, prompt_mask = rows["input_ids"], rows["attention_mask"]
    responses, mask = generated["responses"], generated["response_mask"]
    input_ids = torch.cat([prompt_ids, responses], dim=1)
    present = generated.tensors.get("response_attention_mask", mask)
    attention_mask = torch.cat([prompt_mask, present.to(prompt_mask.dtype)], dim=1)
    tensors = dict(generated.tensors, input_ids=input_ids, attention_mask=attention_mask,
                   prompt_length=torch.full((len(rows),), prompt_ids.shape[1]))
    # a multi-turn response whose tool turns hold images brings every row's images (the prompt's first)
    images = generated if generated.image_counts is not None else rows
    response_types = tensors.pop("response_mm_token_type_ids", torch.zeros_like(responses))
    if "mm_token_type_ids" in rows:
        types = torch.cat([rows["mm_token_type_ids"], response_types.to(rows["mm_token_type_ids"].dtype)], dim=1)
        tensors["mm_token_type_ids"] = types
        if family is None:
            raise ValueError("a batch with vision tokens needs its model family to place positions")
        text_responses = not response_types.any()
        if family.rope_rows and text_responses and generated.image_counts is None:  # each prompt's rows once
            once = family.positions(prompts["input_ids"], prompts["mm_token_type_ids"], prompts.tensors,
                                    prompts["attention_mask"]).repeat_interleave(n, dim=1)
            positions = torch.cat([once, once.new_zeros(*once.shape[:2], responses.shape[1])], dim=2)
        else:
            positions = family.positions(input_ids, types, images.tensors, attention_mask)
        if positions.dim() == 3 and text_responses:
            continue_after_prompt(positions, attention_mask, prompt_ids.shape[1])
        tensors["position_ids"] = positions
    else:
        tensors["position_ids"] = text_positions(attention_mask)
    for key in VISUAL_KEYS:
        if key in images.tensors:  # the per-visual rows; the patch rows stay stored once per prompt (pixels)
            tensors[key] = images.tensors[key]
    return Batch(tensors, rows.meta, images.image_counts, images.pixels)


SPANNING = ("input_ids", "attention_mask", "mm_token_type_ids", "position_ids")
"""The tensors of an assembled batch that span prompt and response; the other per-token ones span the response."""
FILL = {"token_versions": -1}
"""What padding holds per tensor (0 for the rest): a token version of -1 marks no token."""


def join_assembled(batches: Sequence[Batch]) -> Batch:
    """Assembled batches (:func:`assemble`: prompts left-padded, responses right-padded) of different widths as
    one batch laid out the same way: each one's prompts padded on the left and responses on the right to the
    widest. (:meth:`Batch.concat` pads on the right only, which would leave a narrower prompt's responses
    starting in the wrong column.)"""
    batches = [b for b in batches if len(b)]
    if not batches:
        return Batch()
    widths = [(b["input_ids"].shape[1] - b["responses"].shape[1], b["responses"].shape[1]) for b in batches]
    prompt, response = max(w[0] for w in widths), max(w[1] for w in widths)
    return Batch.concat([_widened(b, prompt - p, response - r) for b, (p, r) in zip(batches, widths)])


def _widened(batch: Batch, left: int, right: int) -> Batch:
    """``batch`` with ``left`` more prompt columns and ``right`` more response columns of padding."""
    if not left and not right:
        return batch
    tensors = dict(batch.tensors)
    for key, value in batch.tensors.items():
        if key in PACKED_IMAGE_KEYS or value.dim() < 2:
            continue
        pad = (left, right) if key in SPANNING else (0, right)
        tensors[key] = F.pad(value, pad, value=FILL.get(key, 0))
    if "prompt_length" in tensors:
        tensors["prompt_length"] = tensors["prompt_length"] + left
    return Batch(tensors, batch.meta, batch.image_counts, batch.pixels)
