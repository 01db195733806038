"""Bytes of model states each training-side role keeps per device, between phases.

This mirrors what the workers build (``easytrain.workers.base.build_sharded_model``):
every role loads its weights in fp32 (the master copy) and FSDP2 shards them
over the role's shard group; computation runs in ``model.dtype`` through
FSDP's mixed precision. The actor also keeps fp32 gradients of its trainable
parameters (FSDP reduces them in fp32, sharded) and AdamW's two fp32 moments.
``offload.params`` (FSDP's CPU offload) keeps parameters, gradients and so
optimizer states in host RAM. Transient peaks (a gathered block, activations,
logits) are priced elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4
ADAM_MOMENTS = 2
"""AdamW keeps exp_avg and exp_avg_sq per trainable parameter (fp32, sharded like the parameter)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class StateBytes:
    """One device's share of a role's model states, and where they live."""

    params: int
    grads: int
    optimizer: int
    offloaded: bool
    """Whether they live in host RAM (FSDP CPU offload) rather than on the device."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> int:
        return 0 if self.offloaded else self.total

    @property
    def host(self) -> int:
        return self.total if self.offloaded else 0


def shard_degree(shard_size: int, world_size: int) -> int:
    """Ranks one copy of the weights is split over (``fsdp.shard_size``, -1 = the whole role)."""
    return world_size if shard_size == -1 else shard_size


def _share(count: int, degree: int) -> int:
    """Elements one rank holds when ``count`` are split over ``degree`` ranks (FSDP pads to even shards)."""
    return -(-count // degree)


def role_states(total_params: int, trainable_params: int, degree: int, trains: bool,
                offload_params: bool) -> StateBytes:
    """Per-device states of a role whose model has ``total_params`` (trainable ones: ``trainable_params``),
    sharded ``degree`` ways; ``trains`` adds gradients and AdamW moments (the actor)."""
    params = _share(total_params, degree) * FP32
    grads = _share(trainable_params, degree) * FP32 if trains else 0
    optimizer = _share(trainable_params, degree) * FP32 * ADAM_MOMENTS if trains else 0
    return StateBytes(params, grads, optimizer, offload_params)
