"""The SFT side of the actor: next-token loss on assistant tokens, padded or padding-free micro batches.

A micro batch arrives as a right-padded :class:`Batch` (``targets`` holds each
token's next-token label, -100 where nothing is trained) in a planned
:class:`MicroBatch`. Padded, it goes to the model as it is; packed (the
driver's plan under ``worker.actor.padding_free``),
:func:`~easytrain.workers.packed.flatten` turns it into one sequence of
exactly the summed lengths, which Ulysses sequence parallelism
(``worker.actor.ulysses_size``) splits over the ranks of a group: each rank's
loss covers the trained tokens of its chunk.

Logits are computed only where a target exists (``logits_to_keep`` with the
indices), so an answer of a few tokens after a long multimodal prompt does
not materialise a vocabulary-wide row per prompt token.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from easytrain.distributed.batch import Batch, MicroBatch
from easytrain.distributed.fsdp import gathered
from easytrain.data.vision import VISUAL_KEYS
from easytrain.distributed.group import Dispatch, dispatch
from easytrain.workers.actor import ActorWorker
from easytrain.distributed.ulysses import SequenceParallel
from easytrain.workers.forward import MODEL_INPUTS, model_inputs, suppressed_tokens, takes_video_seconds
from easytrain.models.families import Family, family_of
from easytrain.workers.packed import flatten, pad_sequence, token_loss_sum


def padded(batch: Batch, family: Family) -> dict[str, torch.Tensor]:
    """Model inputs and targets of ``batch``, right-padded to its own longest sample, with the attention mask."""
    width = int(batch["attention_mask"].sum(-1).max())
    out = {k: batch[k] for k in (*MODEL_INPUTS, "targets")
           if k in batch and k not in VISUAL_KEYS and k != "mm_token_type_ids"}
    out.update(family.model_kwargs(batch.expanded_tensors()))  # images and videos as the model's own arguments
    for key in ("input_ids", "attention_mask", "targets", "mm_token_type_ids", "position_ids"):
        if key in out:
            out[key] = out[key][..., :width]
    return out


def accumulate_gradients(model: nn.Module, backward: Optional[Callable[[torch.Tensor], None]],
                         micro_batches: list[dict[str, torch.Tensor]], scale: float, device: torch.device,
                         sp: Optional[SequenceParallel] = None) -> tuple[float, int]:
    """Forward (and, given ``backward``, backward) every micro batch with its summed token loss times ``scale``;
    returns the summed loss and the trained tokens, over the whole sequence-parallel group."""
    loss_sum, tokens = 0.0, 0
    for inputs in micro_batches:
        loss, count = token_loss_sum(model, inputs, device, sp)
        if backward is not None:
            backward(loss * scale)
        loss_sum += float(loss.detach())
        tokens += count
    if sp is not None:  # each rank saw its chunk's tokens; the group leader reports the whole share
        totals = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64)
        dist.all_reduce(totals, group=sp.group)
        loss_sum, tokens = float(totals[0]), int(totals[1])
    return loss_sum, tokens


class SFTWorker(ActorWorker):
    """The actor of an SFT run: same model building, strategy and checkpoints as the RL actor."""

    def _inputs(self, micro: MicroBatch) -> dict[str, torch.Tensor]:
        """The model inputs of a micro batch as the driver planned it: padded rows, or one flattened sequence."""
        if not micro.packed:
            return padded(micro.batch, family_of(self.model))
        inputs = flatten(micro.batch, family_of(self.model))
        return pad_sequence(inputs, self.sp.size) if self.sp is not None else inputs

    @dispatch(Dispatch.EACH)
    def sft_update(self, micro_batches: list[MicroBatch], global_tokens: int) -> dict[str, float]:
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
                                                [self._inputs(m) for m in micro_batches], scale, self.device, self.sp)
        stepped = time.time()
        lr = strategy.lr  # the rate this step applies (the schedule advances in step()), as the RL actor logs it
        norm = strategy.step()
        return {"loss_sum": loss_sum, "tokens": float(tokens), "grad_norm": norm, "lr": lr,
                "forward_backward": (started, stepped), "optimizer": (stepped, time.time())}

    @dispatch(Dispatch.EACH)
    @torch.no_grad()
    def sft_eval(self, micro_batches: list[MicroBatch]) -> dict[str, float]:
        """Summed loss and trained tokens of this rank's micro batches (validation loss)."""
        self.model.eval()
        loss_sum, tokens = accumulate_gradients(self.model, None, [self._inputs(m) for m in micro_batches], 1.0,
                                                self.device, self.sp)
        return {"loss_sum": loss_sum, "tokens": float(tokens)}

    @dispatch(Dispatch.SCATTER)
    @torch.no_grad()
    def generate(self, prompts: Batch, max_new_tokens: int, stop_ids: list[int], pad_id: int) -> Batch:
        """Greedy responses to left-padded prompts. Every rank decodes in step (``synced_gpus``): the sharded
        model's collectives need all ranks in every forward."""
        self.model.eval()
        inputs = model_inputs(prompts, self.device, family_of(self.model),
                              tuple(k for k in MODEL_INPUTS if k != "position_ids"), takes_video_seconds(self.model))
        with gathered(self.model, self.cfg.fsdp.full_shard):
            out = self.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                      eos_token_id=stop_ids, pad_token_id=pad_id, use_cache=True,
                                      suppress_tokens=suppressed_tokens(self.model.config) or None,
                                      synced_gpus=self.world_size > 1)
        responses = out[:, inputs["input_ids"].shape[1]:].cpu()
        return Batch({"responses": responses})
