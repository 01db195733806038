"""Padding-free forward passes: a micro batch as one flattened sequence, optionally split by Ulysses.

:func:`flatten` turns a padded micro batch into one sequence of exactly the
summed lengths: the tokens of every sample back to back, position ids
restarting at 0 for each sample and no attention mask, from which
transformers builds attention that keeps samples apart (block-diagonal
causal masks for ``sdpa``/``eager``, variable-length kernels for
``flash_attention_2``; on GPU with ``sdpa`` no mask: the samples are attended
one by one, :mod:`easytrain.models.segments`). A model with multimodal rope
rows takes four rows of positions then: the text position (which marks
sample boundaries) and the three rope axes.

Under sequence parallelism (:mod:`easytrain.distributed.ulysses`) the
sequence is padded to a multiple of the group size with an untrained segment
and every rank of the group runs the same inputs; its decoder layers, head
and logits cover its own chunk only. :func:`kept_logits` computes logits only
at the positions asked for (those inside the rank's chunk), so neither a
long prompt nor the other ranks' tokens materialise vocabulary-wide rows.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

import torch
from torch import nn

from easytrain.algorithms.losses import entropy_from_logits, gather_log_probs, sampling_logits
from easytrain.data.sft import IGNORE
from easytrain.distributed.batch import Batch
from easytrain.distributed.ulysses import SequenceParallel, gather_sequence
from easytrain.models.families import Family, family_of
from easytrain.models.segments import packed_blocks, segments, uses_segments


def flatten(batch: Batch, family: Family) -> dict[str, torch.Tensor]:
    """Model inputs (and ``targets``, when the batch has them) of ``batch`` as one padding-free sequence (batch
    dimension 1), as the model ``family`` takes them. A family with multimodal rotary rows takes four rows of
    positions here (only a 4-row form tells it where samples start, even for text-only data)."""
    rope_rows = family.rope_rows
    mask = batch["attention_mask"].bool()
    out = {"input_ids": batch["input_ids"][mask][None]}
    if "targets" in batch:
        out["targets"] = batch["targets"][mask][None]
    positions = batch["position_ids"]
    text = (mask.long().cumsum(-1) - 1)[mask]
    if positions.dim() == 3:  # (3, B, L) rope axes, plus the text position that marks sample starts
        out["position_ids"] = torch.cat([text[None, None], positions[:, mask][:, None]], dim=0)
    elif rope_rows:  # text-only rows for a VL model: every rope axis is the text position
        out["position_ids"] = text[None, None].expand(4, 1, -1)
    else:
        out["position_ids"] = positions[mask][None]
    out.update(family.visual_kwargs(batch.expanded_tensors()))
    if "mm_token_type_ids" in batch and family.takes_token_types():
        out["mm_token_type_ids"] = batch["mm_token_type_ids"][mask][None]
    return out


def pad_sequence(inputs: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """A flattened sequence padded to a multiple of ``multiple`` tokens with one more sample that trains
    nothing (token 0, positions from 0, no image tokens): Ulysses splits it into equal chunks."""
    length = inputs["input_ids"].shape[1]
    pad = (-length) % multiple
    if not pad:
        return inputs
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], inputs["input_ids"].new_zeros(1, pad)], dim=1)
    positions = inputs["position_ids"]
    extra = torch.arange(pad, dtype=positions.dtype).expand(*positions.shape[:-1], pad)
    out["position_ids"] = torch.cat([positions, extra], dim=-1)
    if "targets" in inputs:
        out["targets"] = torch.cat([inputs["targets"], inputs["targets"].new_full((1, pad), IGNORE)], dim=1)
    if "mm_token_type_ids" in inputs:
        out["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"],
                                              inputs["mm_token_type_ids"].new_zeros(1, pad)], dim=1)
    return out


def sample_positions(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The row of position ids that restarts at every sample (the first of the four multimodal rope rows)."""
    positions = inputs["position_ids"]
    return positions[0] if positions.dim() == 3 else positions


def kept_logits(model: nn.Module, inputs: dict[str, torch.Tensor], keep: torch.Tensor, device: torch.device,
                sp: Optional[SequenceParallel]) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """Logits (B, K, V) at this rank's share of ``keep`` (a bool mask over the flattened sequence, already a multiple
    of the group size), the local indices of those positions, and the rank's chunk of the sequence."""
    length = inputs["input_ids"].shape[1]
    part = slice(0, length) if sp is None else sp.chunk(length)
    local = keep[part].nonzero().squeeze(-1)
    model_inputs = {k: v.to(device) for k, v in inputs.items() if k != "targets"}
    context: Any = nullcontext()
    if sp is not None or ("attention_mask" not in inputs and uses_segments(model)):  # packed: sample by sample
        context = segments(packed_blocks(sample_positions(inputs)))
    with context:
        logits = model(**model_inputs, logits_to_keep=local.to(device), use_cache=False).logits
    return logits, local, part


def packed_response_log_probs(model: nn.Module, batch: Batch, temperature: float, device: torch.device,
                              suppressed: list[int], sp: Optional[SequenceParallel] = None,
                              with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Response log-probs (and entropy) of a micro batch run padding-free, shape (B, R) like the padded path's;
    0 where ``response_mask`` is 0. Under sequence parallelism every rank of the group returns the whole (B, R)
    (per-token values gathered from the chunks; the gather's backward keeps each rank's own chunk)."""
    mask = batch["attention_mask"].bool()
    rows, width = mask.shape
    responses = batch["responses"]
    length = responses.shape[1]
    valid = batch["response_mask"].bool() & mask[:, width - length:]
    flat_index = (mask.reshape(-1).long().cumsum(0) - 1).view(rows, width)
    source = flat_index[:, width - length:][valid] - 1  # the position whose logits predict each response token
    inputs = flatten(batch, family_of(model))
    inputs = pad_sequence(inputs, sp.size if sp is not None else 1)
    keep = torch.zeros(inputs["input_ids"].shape[1], dtype=torch.bool)
    keep[source] = True
    logits, local, part = kept_logits(model, inputs, keep, device, sp)
    scaled = sampling_logits(logits[0], temperature, suppressed)
    next_tokens = torch.zeros_like(keep, dtype=torch.long)
    next_tokens[source] = responses[valid]
    chunk = part.stop - part.start

    def to_rows(values: torch.Tensor) -> torch.Tensor:
        """Per kept position (local) -> the whole flattened sequence -> (B, R)."""
        spread = values.new_zeros(chunk).index_put((local.to(values.device),), values)
        full = spread if sp is None else gather_sequence(spread, sp, dim=0)
        return values.new_zeros(rows, length).index_put(tuple(i.to(values.device) for i in valid.nonzero(as_tuple=True)),
                                                         full[source.to(values.device)])

    log_probs = to_rows(gather_log_probs(scaled, next_tokens[part][local].to(device)))
    entropy = to_rows(entropy_from_logits(scaled)) if with_entropy else None
    return log_probs, entropy


def token_loss_sum(model: nn.Module, inputs: dict[str, torch.Tensor], device: torch.device,
                   sp: Optional[SequenceParallel] = None) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the trained positions (of this rank's chunk under sequence
    parallelism), and how many there are. Padded batches (B > 1) keep whole columns where any row trains."""
    targets = inputs["targets"]
    keep = (targets != IGNORE).any(0)
    logits, local, part = kept_logits(model, inputs, keep, device, sp)
    kept = targets[:, part][:, local].to(device)
    if local.numel() == 0:  # nothing trained here: a zero that still takes part in backward
        return logits.sum() * 0.0, 0
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), kept.reshape(-1),
                                       ignore_index=IGNORE, reduction="sum")
    return loss, int((kept != IGNORE).sum())
