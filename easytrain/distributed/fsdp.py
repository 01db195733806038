"""FSDP2 for one role: activation checkpointing, then ``fully_shard`` per block, then the root.

Blocks are the model's own "do not split" modules (decoder layers and vision
blocks of a vision-language model). The role's settings decide the mesh (full shard over all
ranks, or hybrid: shard within groups of ``shard_size``, replicate across),
whether parameters are resharded after forward (``full_shard``), parameter
offload (``CPUOffloadPolicy``; unpinned memory on CPU, where pinning needs an
accelerator) and mixed precision (bf16 parameters with fp32 gradient
reduction on GPU; fp32 throughout on CPU unless asked otherwise).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

logger = logging.getLogger(__name__)


def build_mesh(device_type: str, world_size: int, shard_size: int) -> DeviceMesh:
    """1-D mesh for full sharding, or (replicate, shard) for hybrid sharding."""
    if shard_size in (-1, world_size):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world_size // shard_size, shard_size),
                            mesh_dim_names=("replicate", "shard"))


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP wraps one by one: the model's declared no-split blocks."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute activations in backward (transformers' implementation, non-reentrant), each layer under the
    attention layout its forward ran with (a packed or prompt-shared pass: models/segments.py)."""
    from easytrain.models.segments import checkpoint_contexts

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                       "context_fn": checkpoint_contexts})
    if hasattr(model, "config"):
        model.config.use_cache = False


def apply_fsdp(model: nn.Module, *, mesh: DeviceMesh, reshard_after_forward: bool, offload_params: bool,
               param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype], device_type: str) -> nn.Module:
    """Shard ``model`` in place: every block, then the root (which holds embeddings, norms, head)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=device_type == "cuda") if offload_params else OffloadPolicy()
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    logger.debug("FSDP2: %d blocks + root on mesh %s, offload=%s", len(blocks), tuple(mesh.shape), offload_params)
    return model


def offload_policies(model: nn.Module) -> list[str]:
    """Class names of the offload policy installed on every FSDP module (for checks and logs)."""
    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()  # noqa: SLF001 - torch exposes no public getter
            group = state._fsdp_param_group  # noqa: SLF001
            if group is not None:
                out.append(type(group.offload_policy).__name__)
    return out


def parameter_devices(model: nn.Module) -> set[str]:
    """Device types where the (sharded) parameters live right now."""
    devices = set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        devices.add(local.device.type)
    return devices


@contextmanager
def gathered(model: nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """Every FSDP2 unit of ``model`` unsharded for the block, kept so across forwards (HF ``generate`` calls
    parts of the model, e.g. the vision tower's patch embedding, outside the root's forward hooks); resharded
    after. Holds the full model on each rank meanwhile. A model without FSDP units passes through."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)
            unit.reshard()
