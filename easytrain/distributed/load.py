"""Loading a model that FSDP2 shards over several ranks with one full host copy, not one per rank.

The plain way (every rank ``from_pretrained`` in full, then ``fully_shard``) holds ``world_size`` full fp32
copies on a node at once: 16 x 33 GB for a 7B model on one 16-process node. Here (as torchtitan and verl do)
only rank 0 reads the checkpoint; every other rank builds the same architecture on the meta device (no
storage), and all ranks apply the same transformations in the same order (the caller's ``prepare``: Ulysses
hooks, frozen parts, activation checkpointing, LoRA; then its ``shard``: ``fully_shard``). The ranks other than
0 then allocate their (empty) shards, and ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True))`` sends rank 0's full tensors one at a time, each rank keeping only its slice.

What the state dict does not hold is sent too: non-persistent buffers (the rotary ``inv_freq`` of the text
model and the vision tower) are broadcast from rank 0 buffer by buffer, in ``named_buffers`` order (the same
module tree on every rank). LoRA adapters are in the state dict, so every rank ends with rank 0's
initialisation (each rank seeds differently; without this each would keep its own shard of its own init).

Peak host memory of the load: rank 0 holds the loaded model (one copy) plus its own shard; every other rank
its shard plus the one tensor in flight. A single process, or a model left whole for DeepSpeed, does not come
here: one process needs one copy anyway.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from easytrain.config.schema import ModelConfig
from easytrain.models.hf import family, load_model

logger = logging.getLogger(__name__)


def meta_model(model_cfg: ModelConfig, folder: str) -> nn.Module:
    """The architecture of ``folder`` in fp32 on the meta device (no storage, no reads of the weights), with the
    attention implementation and generation defaults ``from_pretrained`` would give it."""
    from transformers import AutoConfig, GenerationConfig

    hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=model_cfg.trust_remote_code)
    cls = family(folder).model_class()
    with torch.device("meta"):
        model = cls._from_config(hf_config, dtype=torch.float32,  # noqa: SLF001 - transformers' own constructor
                                 attn_implementation=model_cfg.attn_implementation)
    try:  # from_pretrained reads generation_config.json (eos ids, sampling defaults) where the folder has one
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        logger.debug("no generation config in %s (%s): the model config's defaults", folder, error)
    return model


def materialise(model: nn.Module, device: torch.device) -> None:
    """Storage (uninitialised) for every meta parameter and buffer of ``model`` on ``device``, in place: the
    sharded parameters get their local shard's size. Tied weights must stay tied: FSDP2 swaps its sharded
    parameters in place (one object per shared parameter before and after), which is checked here, since a
    plain module's ``to_empty`` from meta unties them."""
    before = _distinct_parameters(model)
    model.to_empty(device=device)
    after = _distinct_parameters(model)
    if after != before:
        raise RuntimeError(f"materialising the meta model untied shared parameters ({before} distinct before, "
                           f"{after} after)")


def _distinct_parameters(model: nn.Module) -> int:
    return len({id(p) for _, p in model.named_parameters(remove_duplicate=False)})


def broadcast_buffers(model: nn.Module, src: int = 0) -> int:
    """Send rank ``src``'s value of every buffer of ``model`` to the other ranks (same module tree everywhere;
    the non-persistent ones, such as rotary frequencies, are not in the state dict). Returns how many."""
    count = 0
    for _, buffer in model.named_buffers():
        dist.broadcast(buffer.data, src=src)
        count += 1
    return count


def load_from_rank0(model_cfg: ModelConfig, folder: str, *, prepare: Callable[[nn.Module], nn.Module],
                    shard: Callable[[nn.Module], Any], device: torch.device) -> nn.Module:
    """The model of ``folder``, prepared and sharded, with rank 0's weights, buffers and adapters on every rank.

    ``prepare(model) -> model`` applies everything before sharding (it may wrap the model: LoRA) and ``shard``
    applies ``fully_shard``; both run on every rank, on the loaded model on rank 0 and on a meta copy elsewhere,
    so they must not depend on weight values. ``device`` is where the shards are filled (CPU with parameter
    offload); buffers follow it. Every rank of the default process group must call this.
    """
    rank = dist.get_rank()
    if rank == 0:
        model = load_model(model_cfg, folder, dtype="float32")
        logger.info("rank 0 loaded %s; the other %d rank(s) build it on the meta device", folder,
                    dist.get_world_size() - 1)
    else:
        model = meta_model(model_cfg, folder)
    model = prepare(model)
    full: Optional[dict[str, torch.Tensor]] = None
    if rank == 0:
        # References to the loaded tensors (no copy): fully_shard gives the model its own shards and these stay
        # the source of the broadcast. LoRA adapters are in here too: every rank gets rank 0's initialisation.
        full = model.state_dict()
    shard(model)
    if rank == 0:
        model.to(device)
    else:
        materialise(model, device)
    fill(model, full)
    del full  # rank 0's full copy goes with the last reference
    return model


def fill(model: nn.Module, full: Optional[dict[str, torch.Tensor]]) -> None:
    """Every rank's parameters (their shards) and buffers set from rank 0: ``full`` (the full state dict) on
    rank 0, None elsewhere. Collective over the default group."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full if full is not None else {}, options=options)
    count = broadcast_buffers(model)
    logger.debug("weights and %d buffers received from rank 0", count)
