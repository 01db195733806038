"""The SFT side of the actor: next-token loss on assistant tokens, padded or padding-free micro batches.

A micro batch arrives as a right-padded :class:`Batch` (``targets`` holds each
token's next-token label, -100 where nothing is trained). Padded, it goes to
the model as it is; padding-free (``worker.actor.padding_free``),
:func:`flatten` turns it into one sequence of exactly the summed lengths:
the tokens of every sample back to back, position ids restarting at 0 for
each sample and no attention mask, from which transformers builds attention
that keeps samples apart (block-diagonal causal masks for ``sdpa``/``eager``
on CPU, variable-length kernels for ``flash_attention_2`` on GPU). Qwen-VL
takes four rows of positions then: the text position (which marks sample
boundaries) and the three rope axes.

Logits are computed only where a target exists (``logits_to_keep`` with the
indices), so an answer of a few tokens after a long multimodal prompt does
not materialise a vocabulary-wide row per prompt token.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import nn

from easytrain.data.sft import IGNORE
from easytrain.distributed.batch import Batch
from easytrain.distributed.fsdp import gathered
from easytrain.distributed.group import Dispatch, dispatch
from easytrain.workers.actor import ActorWorker
from easytrain.workers.forward import MODEL_INPUTS, suppressed_tokens

logger = logging.getLogger(__name__)


def flatten(batch: Batch, rope_rows: bool = True) -> dict[str, torch.Tensor]:
    """Model inputs and targets of ``batch`` as one padding-free sequence (batch dimension 1). ``rope_rows``:
    the model takes Qwen-VL's multi-row positions (only a 4-row form tells it where samples start, even for
    text-only data)."""
    mask = batch["attention_mask"].bool()
    out = {"input_ids": batch["input_ids"][mask][None], "targets": batch["targets"][mask][None]}
    positions = batch["position_ids"]
    text = (mask.long().cumsum(-1) - 1)[mask]
    if positions.dim() == 3:  # (3, B, L) rope axes, plus the text position that marks sample starts
        out["position_ids"] = torch.cat([text[None, None], positions[:, mask][:, None]], dim=0)
    elif rope_rows:  # text-only rows for a VL model: every rope axis is the text position
        out["position_ids"] = text[None, None].expand(4, 1, -1)
    else:
        out["position_ids"] = positions[mask][None]
    if "mm_token_type_ids" in batch:
        out["mm_token_type_ids"] = batch["mm_token_type_ids"][mask][None]
    for key in ("pixel_values", "image_grid_thw"):
        if key in batch:
            out[key] = batch[key]
    return out


def padded(batch: Batch) -> dict[str, torch.Tensor]:
    """Model inputs and targets of ``batch``, right-padded to its own longest sample, with the attention mask."""
    width = int(batch["attention_mask"].sum(-1).max())
    out = {k: batch[k] for k in (*MODEL_INPUTS, "targets") if k in batch}
    for key in ("input_ids", "attention_mask", "targets", "mm_token_type_ids", "position_ids"):
        if key in out:
            out[key] = out[key][..., :width]
    return out


def token_loss_sum(model: nn.Module, inputs: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the trained positions, and how many there are."""
    targets = inputs["targets"].to(device)
    columns = (targets != IGNORE).any(0).nonzero().squeeze(-1)
    if columns.numel() == 0:  # nothing trained here: a zero that still takes part in backward
        logits = model(**{k: v.to(device) for k, v in inputs.items() if k != "targets"},
                       logits_to_keep=1, use_cache=False).logits
        return logits.sum() * 0.0, 0
    model_inputs = {k: v.to(device) for k, v in inputs.items() if k != "targets"}
    logits = model(**model_inputs, logits_to_keep=columns, use_cache=False).logits.float()
    kept = targets[:, columns]
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), kept.reshape(-1),
                                       ignore_index=IGNORE, reduction="sum")
    return loss, int((kept != IGNORE).sum())


def accumulate_gradients(model: nn.Module, backward: Callable[[torch.Tensor], None],
                         micro_batches: list[dict[str, torch.Tensor]], scale: float,
                         device: torch.device) -> tuple[float, int]:
    """Forward and backward every micro batch with its summed token loss times ``scale``; returns the summed
    loss and the trained tokens."""
    loss_sum, tokens = 0.0, 0
    for inputs in micro_batches:
        loss, count = token_loss_sum(model, inputs, device)
        backward(loss * scale)
        loss_sum += float(loss.detach())
        tokens += count
    return loss_sum, tokens


class SFTWorker(ActorWorker):
    """The actor of an SFT run: same model building, strategy and checkpoints as the RL actor."""

    def _inputs(self, micro: Batch) -> dict[str, torch.Tensor]:
        if not self.cfg.padding_free:
            return padded(micro)
        return flatten(micro, rope_rows=getattr(self.model.config, "vision_config", None) is not None)

    @dispatch(Dispatch.EACH)
    def sft_update(self, micro_batches: list[Batch], global_tokens: int) -> dict[str, float]:
        """One optimizer step over this rank's micro batches; the loss is the token mean over the global batch
        (``global_tokens`` trained tokens on all ranks), so any split into ranks and micro batches gives the
        same gradient."""
        strategy = self.strategy
        assert strategy is not None
        self.model.train()
        strategy.zero_grad()
        scale = self.world_size / max(1, global_tokens)  # the strategies average gradients over ranks
        started = time.time()
        loss_sum, tokens = accumulate_gradients(self.model, strategy.backward,
                                                [self._inputs(m) for m in micro_batches], scale, self.device)
        stepped = time.time()
        norm = strategy.step()
        return {"loss_sum": loss_sum, "tokens": float(tokens), "grad_norm": norm, "lr": strategy.lr,
                "forward_backward": (started, stepped), "optimizer": (stepped, time.time())}

    @dispatch(Dispatch.EACH)
    @torch.no_grad()
    def sft_eval(self, micro_batches: list[Batch]) -> dict[str, float]:
        """Summed loss and trained tokens of this rank's micro batches (validation loss)."""
        self.model.eval()
        loss_sum, tokens = 0.0, 0
        for micro in micro_batches:
            loss, count = token_loss_sum(self.model, self._inputs(micro), self.device)
            loss_sum, tokens = loss_sum + float(loss), tokens + count
        return {"loss_sum": loss_sum, "tokens": float(tokens)}

    @dispatch(Dispatch.SCATTER)
    @torch.no_grad()
    def generate(self, prompts: Batch, max_new_tokens: int, stop_ids: list[int], pad_id: int) -> Batch:
        """Greedy responses to left-padded prompts. Every rank decodes in step (``synced_gpus``): the sharded
        model's collectives need all ranks in every forward."""
        self.model.eval()
        inputs = {k: prompts[k].to(self.device) for k in MODEL_INPUTS if k in prompts and k != "position_ids"}
        with gathered(self.model, self.cfg.fsdp.full_shard):
            out = self.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                      eos_token_id=stop_ids, pad_token_id=pad_id, use_cache=True,
                                      suppress_tokens=suppressed_tokens(self.model.config) or None,
                                      synced_gpus=self.world_size > 1)
        responses = out[:, inputs["input_ids"].shape[1]:].cpu()
        return Batch({"responses": responses})
