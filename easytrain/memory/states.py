"""Bytes of model states each training-side role keeps per device, between phases.

This mirrors what the workers build (``easytrain.workers.base.build_sharded_model``):
every role loads its weights in fp32 (the master copy) and FSDP2 shards them
over the role's shard group; computation runs in ``model.dtype`` through
FSDP's mixed precision. The actor also keeps fp32 gradients of its trainable
parameters (FSDP reduces them in fp32, sharded) and AdamW's two fp32 moments.
``offload.params`` (FSDP's CPU offload) keeps parameters, gradients and so
optimizer states in host RAM. The SFT actor may run DeepSpeed ZeRO instead
(``worker.actor.strategy=deepspeed``): :func:`zero_states`. Transient peaks
(activations, logits) are priced elsewhere; the gathered units of a sharded
pass here (:func:`gathered_bytes`).
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


def gathered_bytes(total: int, root: int, block: int, dtype_bytes: int, *, grad: bool, reshard: bool,
                   kept: bool = False) -> int:
    """Transient unsharded parameters of a sharded pass (FSDP2, or ZeRO-3 which gathers the same way): the
    root unit (``root`` elements: embeddings, head, vision patch embedding and merger) for the whole pass
    plus two blocks of ``block`` elements (current and prefetched), in the compute dtype; with ``grad``
    one block's unsharded fp32 gradient before its reduce-scatter. Without ``reshard`` (FSDP's
    ``full_shard=false``) every unit stays gathered from its forward to its backward: the whole model. With ``kept`` (a CPU
    worker under glibc's dynamic mmap threshold: :func:`easytrain.memory.host.heap_keeps_freed`) every unit a pass
    gathered stays in the heap once freed, until the call ends: the whole model."""
    held = total if kept or (grad and not reshard) else root + 2 * block
    return held * dtype_bytes + (block * FP32 if grad else 0)


# ----------------------------------------------------------------------------- DeepSpeed ZeRO

ZERO_REDUCE_BUCKET = 500_000_000
"""Elements of DeepSpeed's gradient reduce bucket (``reduce_bucket_size``, its default), in the compute dtype."""
ZERO_SUB_GROUP = 1_000_000_000
"""Elements ZeRO-3 steps at once (``sub_group_size``, its default): the optimizer step's fp32 gradient copy and
AdamW's temporaries cover one sub-group of the rank's partition."""


@dataclass(frozen=True)
class ZeroStates:
    """One rank's DeepSpeed ZeRO states, where each lives, and its optimizer step's temporaries.

    Parameters and gradients are in the compute dtype (``model.dtype``); the optimizer keeps an fp32 master
    copy of its partition (ZeRO-1/2 always clone it; ZeRO-3 uses the parameters themselves when they are
    fp32 and on the device) and AdamW's two fp32 moments."""

    params: int
    grads: int
    """Compute-dtype gradients on the device from the first backward to the step (none with
    ``offload_optimizer`` at stage >= 2: each reduced bucket goes straight to the host's fp32 partition)."""
    master: int
    moments: int
    host_grads: int
    """The fp32 gradient partition the host's optimizer steps on (``offload_optimizer``), kept between steps."""
    params_on_host: bool
    optimizer_on_host: bool
    step_grads: int
    """fp32 gradient partition made at the step when the optimizer steps on the device (the host keeps one)."""
    step_temporaries: int
    """AdamW's sqrt and denominator over one flat partition (or ZeRO-3 sub-group), where the optimizer is."""


def zero_states(total_params: int, trainable_params: int, ranks: int, dtype_bytes: int, stage: int,
                offload_params: bool, offload_optimizer: bool) -> ZeroStates:
    """ZeRO ``stage`` over ``ranks`` data-parallel ranks: 1 partitions the optimizer states (master copy and
    moments), 2 also the gradients, 3 also the parameters; stage 0 partitions nothing."""
    part = _share(trainable_params, ranks) if stage >= 1 else trainable_params
    params = (_share(total_params, ranks) if stage >= 3 else total_params) * dtype_bytes
    grads = (_share(trainable_params, ranks) if stage >= 2 else trainable_params) * dtype_bytes
    if offload_optimizer and stage >= 2:
        grads = 0
    own_master = stage >= 3 and dtype_bytes == FP32 and not offload_optimizer
    master = 0 if own_master else part * FP32
    step = min(part, ZERO_SUB_GROUP) if stage >= 3 else part
    return ZeroStates(params=params, grads=grads, master=master, moments=part * FP32 * ADAM_MOMENTS,
                      host_grads=part * FP32 if offload_optimizer else 0,
                      params_on_host=offload_params and stage >= 3, optimizer_on_host=offload_optimizer,
                      step_grads=0 if offload_optimizer else step * FP32, step_temporaries=2 * step * FP32)
