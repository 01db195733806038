"""Forward passes over prompt+response sequences: per-token log-probs and entropy of the responses."""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import nn

from easytrain.algorithms.losses import entropy_from_logits, gather_log_probs, sampling_logits
from easytrain.distributed.batch import Batch
from easytrain.distributed.ulysses import SequenceParallel
from easytrain.workers.packed import packed_response_log_probs
from easytrain.workers.shared_prompt import (prompt_groups, rows_pay_off, shared_response_log_probs,
                                             supports_shared_prompt, text_config, worth_sharing)

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def model_inputs(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}


def suppressed_tokens(config: Any) -> list[int]:
    """Tokens a response may never contain: the vision placeholders (an image token in a response
    would not match any image feature). Generation suppresses them and log-probs exclude them."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(getattr(config, n)) for n in names if getattr(config, n, None) is not None})


def response_log_probs(model: nn.Module, batch: Batch, temperature: float, device: torch.device,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the sampling distribution at each response token, shape (B, R).

    Responses start at the same column for every row (prompts are left-padded),
    so only the last R+1 positions' logits are computed.
    """
    responses = batch["responses"].to(device)
    length = responses.shape[1]
    logits = model(**model_inputs(batch, device), logits_to_keep=length + 1, use_cache=False).logits[:, :-1]
    scaled = sampling_logits(logits, temperature, suppressed_tokens(model.config))
    log_probs = gather_log_probs(scaled, responses)
    entropy = entropy_from_logits(scaled) if with_entropy else None
    return log_probs, entropy


def log_probs_of(model: nn.Module, micro: Batch, temperature: float, device: torch.device, packed: bool,
                 sp: Optional[SequenceParallel] = None, with_entropy: bool = False,
                 share_prompt: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response log-probs (and entropy) of a micro batch, (B, R): padded, or padding-free (``packed``, which
    sequence parallelism needs), or with each repeated prompt run once (``share_prompt``, where the attention
    takes a mask and there is no sequence parallelism; see :mod:`easytrain.workers.shared_prompt`)."""
    if share_prompt and sp is None and supports_shared_prompt(model):
        groups = prompt_groups(micro)
        # padding-free: one row of exactly the tokens (each prompt once); padded: a row per prompt, if cheaper
        if worth_sharing(groups) and (packed or rows_pay_off(micro, groups, text_config(model).hidden_size)):
            return shared_response_log_probs(model, micro, groups, temperature, device,
                                             suppressed_tokens(model.config), with_entropy, one_row=packed)
    if not packed:
        return response_log_probs(model, micro, temperature, device, with_entropy)
    return packed_response_log_probs(model, micro, temperature, device, suppressed_tokens(model.config), sp,
                                     with_entropy)


@torch.no_grad()
def planned_log_probs(model: nn.Module, micro_batches: list[Batch], temperature: float, device: torch.device,
                      sp: Optional[SequenceParallel], share_prompt: bool = False) -> list[torch.Tensor]:
    """Response log-probs of micro batches the driver planned (padding-free), one (B, R) tensor each, on CPU."""
    return [log_probs_of(model, micro, temperature, device, True, sp, share_prompt=share_prompt)[0].cpu()
            for micro in micro_batches]


@torch.no_grad()
def batch_log_probs(model: nn.Module, batch: Batch, micro_size: int, temperature: float,
                    device: torch.device, share_prompt: bool = False) -> torch.Tensor:
    """Response log-probs of a whole batch, micro batch by micro batch, without gradients (on CPU)."""
    return torch.cat([log_probs_of(model, micro, temperature, device, False, share_prompt=share_prompt)[0].cpu()
                      for micro in micro_batches(batch, micro_size)])


def micro_batches(batch: Batch, size: int) -> Iterator[Batch]:
    for start in range(0, len(batch), size):
        yield batch.select(range(start, min(start + size, len(batch))))
