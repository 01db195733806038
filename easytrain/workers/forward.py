"""Forward passes over prompt+response sequences: per-token log-probs and entropy of the responses."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from easytrain.algorithms.losses import entropy_from_logits, gather_log_probs, sampling_logits
from easytrain.data.vision import VISUAL_KEYS
from easytrain.distributed.batch import Batch, MicroBatch
from easytrain.distributed.ulysses import SequenceParallel
from easytrain.models.families import Family, adapter_class, family_of
from easytrain.workers.packed import packed_response_log_probs
from easytrain.workers.shared_prompt import shared_response_log_probs

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", *VISUAL_KEYS, "mm_token_type_ids")


TOKEN_TYPES = "mm_token_type_ids"


def model_inputs(batch: Batch, device: torch.device, family: Family, keys: tuple[str, ...] = MODEL_INPUTS,
                 seconds_arg: bool = False) -> dict[str, torch.Tensor]:
    """``batch``'s ``keys`` on ``device`` as the model's arguments: the vision stream (and the token types) as the
    ``family``'s adapter says the model takes them (``seconds_arg`` where the model computes positions itself)."""
    inputs = {k: batch[k].to(device) for k in keys if k in batch and k not in VISUAL_KEYS and k != TOKEN_TYPES}
    if any(k in VISUAL_KEYS for k in keys):
        extra = family.model_kwargs(batch.expanded_tensors(), seconds_arg)
        if TOKEN_TYPES not in keys:
            extra.pop(TOKEN_TYPES, None)
        inputs.update({k: v.to(device) for k, v in extra.items()})
    return inputs


def takes_video_seconds(model: nn.Module) -> bool:
    """Whether the model spaces video positions by time, so generation passes each video's seconds per temporal
    patch."""
    return family_of(model).time_scale() is not None


def suppressed_tokens(config: Any) -> list[int]:
    """Tokens a response may never contain: the vision placeholders (an image token in a response
    would not match any image feature). Generation suppresses them and log-probs exclude them."""
    names = adapter_class(str(getattr(config, "model_type", ""))).placeholder_names
    return sorted({int(getattr(config, n)) for n in names if getattr(config, n, None) is not None})


def response_log_probs(model: nn.Module, batch: Batch, temperature: float, device: torch.device,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the sampling distribution at each response token, shape (B, R).

    Responses start at the same column for every row (prompts are left-padded),
    so only the last R+1 positions' logits are computed.
    """
    responses = batch["responses"].to(device)
    length = responses.shape[1]
    inputs = model_inputs(batch, device, family_of(model))
    logits = model(**inputs, logits_to_keep=length + 1, use_cache=False).logits[:, :-1]
    scaled = sampling_logits(logits, temperature, suppressed_tokens(model.config))
    log_probs = gather_log_probs(scaled, responses)
    entropy = entropy_from_logits(scaled) if with_entropy else None
    return log_probs, entropy


def log_probs_of(model: nn.Module, micro: MicroBatch, temperature: float, device: torch.device,
                 sp: Optional[SequenceParallel] = None,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response log-probs (and entropy) of a micro batch, (B, R), laid out as the driver planned it: padded
    rows, or padding-free (``packed``, which sequence parallelism needs), or each repeated prompt run once
    (``prompt_groups``: one row per prompt, or all of them in one row when packed; see
    :mod:`easytrain.workers.shared_prompt`)."""
    batch = micro.batch
    if micro.prompt_groups is not None:
        if sp is not None:
            raise ValueError("a prompt-shared micro batch cannot be split by sequence parallelism; the plan "
                             "shares prompts only where worker.actor.ulysses_size and worker.ref.ulysses_size are 1")
        return shared_response_log_probs(model, batch, micro.prompt_groups, temperature, device,
                                         suppressed_tokens(model.config), with_entropy, one_row=micro.packed)
    if not micro.packed:
        return response_log_probs(model, batch, temperature, device, with_entropy)
    return packed_response_log_probs(model, batch, temperature, device, suppressed_tokens(model.config), sp,
                                     with_entropy)


@torch.no_grad()
def micro_log_probs(model: nn.Module, micros: Sequence[MicroBatch], temperature: float, device: torch.device,
                    sp: Optional[SequenceParallel] = None) -> list[torch.Tensor]:
    """Response log-probs of this rank's planned micro batches, one (B, R) tensor each, on CPU."""
    return [log_probs_of(model, micro, temperature, device, sp)[0].cpu() for micro in micros]
