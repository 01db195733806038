"""The memory plan: bytes per GPU and per node for every role in every phase, before anything starts.

``plan(config)`` prices each phase of an RL step (generation, reference log-probs,
old log-probs, update, weight sync, validation) from the composed config and
the model's HF config alone: the role that works in the phase holds its
states plus its transient peak (gathered FSDP units, activations, logits, KV
cache), the others hold what they keep between phases. Colocated roles share
a device over time, so a device's peak is its largest phase, not the sum of
roles. On CPU the "device" is the node's RAM: each role is a process, and the
node total adds them up. An SFT run (``trainer.task=sft``) is planned by
:mod:`easytrain.memory.sft`: its one role, the actor, in its own phases.

The actor's and reference's passes take micro batches of
``micro_batch_size_per_device_for_update`` (update) or ``_for_experience``
(log-probs) padded sequences of ``data.max_prompt_length +
data.max_response_length`` tokens, or with ``worker.actor.padding_free`` one
flattened sequence of up to ``worker.actor.max_token_len_per_device`` tokens
(batch dimension 1, no padding) for all three, priced as full-length samples
packed back to back (:func:`packed_micro`): as many as fit, with their images.
The packed path computes logits only where a response token is predicted: the
packed samples' response positions. A role's data-parallel size is the world
over its ``ulysses_size``; under sequence parallelism each of the group's
ranks holds 1/``ulysses_size`` of the sequence's activations and computes
logits for its chunk, priced as an even share of the response positions.

Assumptions (the per-process ones in :mod:`easytrain.memory.capacity`): vLLM
reserves ``gpu_memory_utilization`` x the GPU while awake and, in sleep
level 2, frees all of it between rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from easytrain.config.schema import Config
from easytrain.config.validate import needs_reference
from easytrain.memory.activations import (PATCH_VALUES, MicroBatch, activation_bytes, logits_bytes, model_dims,
                                          packed_micro, shard_units)
from easytrain.memory.budget import engine_budget, kv_bytes_per_token, sequence_shape
from easytrain.memory.capacity import (CUDA_CONTEXT_BYTES, DRIVER_BYTES, FRAMEWORK_BYTES, GB, Capacity, Plan, Row,
                                       capacity_of, sum_parts)
from easytrain.memory.params import count_parameters, largest_trainable, trainable_by_component
from easytrain.memory.sft import plan_sft, sft_worker_parts
from easytrain.memory.states import DTYPE_BYTES, FP32, gathered_bytes, role_states, shard_degree

__all__ = ["CUDA_CONTEXT_BYTES", "GB", "Capacity", "Plan", "Row", "capacity_of", "plan", "worker_bytes",
           "worker_parts", "shape_of", "update_transient"]

PHASES = ("generation", "ref_log_probs", "old_log_probs", "update", "weight_sync", "validation")


# ----------------------------------------------------------------------------- the run's shape


@dataclass(frozen=True)
class Shape:
    """What the plan needs from the config and model, computed once."""

    world: int
    per_node: int
    total_params: int
    trainable: dict[str, int]
    largest_trainable: int
    """Elements of the largest trainable parameter."""
    seq_tokens: int
    response: int
    images: int
    image_tokens: int
    dtype_bytes: int
    with_ref: bool
    old_log_probs: bool
    on_gpu: bool


def shape_of(config: Config, hf_config: dict[str, Any]) -> Shape:
    t, a, d = config.trainer, config.worker.actor, config.data
    seq = sequence_shape(config, hf_config)
    on_policy = a.ppo_epochs == 1 and d.rollout_batch_size == a.global_batch_size
    return Shape(world=t.nnodes * t.workers_per_node, per_node=t.workers_per_node,
                 total_params=count_parameters(hf_config).total,
                 trainable=trainable_by_component(hf_config, config.model),
                 largest_trainable=largest_trainable(hf_config, config.model),
                 seq_tokens=seq.total, response=seq.response, images=seq.images, image_tokens=seq.image_tokens,
                 dtype_bytes=DTYPE_BYTES[config.model.dtype], with_ref=needs_reference(config),
                 old_log_probs=not (on_policy and a.reuse_log_probs_on_policy), on_gpu=t.device == "cuda")


def per_rank(config: Config, s: Shape, role: str, prompts: int) -> int:
    """Sequences of ``prompts`` x n one data-parallel member of ``role`` works on: the world over its
    ``ulysses_size`` ranks, each group sharing its members' sequences."""
    return max(1, prompts * config.worker.rollout.n // max(1, s.world // getattr(config.worker, role).ulysses_size))


def _micro(config: Config, s: Shape, size: int, sequences: int) -> MicroBatch:
    """A rank's micro batch among ``sequences``: ``size`` padded ones, or padding-free one flattened sequence of
    ``max_token_len_per_device`` tokens (no more than the rank's sequences hold)."""
    if config.worker.actor.padding_free:
        budget = min(config.worker.actor.max_token_len_per_device, sequences * s.seq_tokens)
        return packed_micro(budget, s.seq_tokens, s.response, s.images, s.image_tokens)
    return MicroBatch(min(size, sequences), s.seq_tokens, s.response, s.images, s.image_tokens)


def experience_micro(config: Config, s: Shape, role: str) -> MicroBatch:
    """One log-prob pass's micro batch on a rank of ``role`` (actor or ref)."""
    sequences = per_rank(config, s, role, config.data.rollout_batch_size)
    return _micro(config, s, config.worker.actor.micro_batch_size_per_device_for_experience, sequences)


def update_micro(config: Config, s: Shape) -> tuple[MicroBatch, bool]:
    """The update's micro batch on an actor rank, and whether the rank accumulates gradients over several."""
    a = config.worker.actor
    sequences = per_rank(config, s, "actor", a.global_batch_size)
    micro = _micro(config, s, a.micro_batch_size_per_device_for_update, sequences)
    if a.padding_free:
        return micro, sequences * s.seq_tokens > a.max_token_len_per_device
    return micro, sequences > micro.sequences


def _gathered(config: Config, s: Shape, hf_config: dict[str, Any], role: str, grad: bool) -> int:
    """FSDP's transient unsharded parameters (:func:`gathered_bytes`); nothing when FSDP is not applied
    (1 rank, fp32)."""
    role_cfg = getattr(config.worker, role)
    degree = shard_degree(role_cfg.fsdp.shard_size, s.world)
    if degree == 1 and s.dtype_bytes == FP32:
        return 0
    root, block = shard_units(hf_config)
    return gathered_bytes(s.total_params, root, block, s.dtype_bytes, grad=grad, reshard=role_cfg.fsdp.full_shard)


# ----------------------------------------------------------------------------- per role


def actor_states(config: Config, s: Shape) -> Any:
    a = config.worker.actor
    return role_states(s.total_params, sum(s.trainable.values()), shard_degree(a.fsdp.shard_size, s.world),
                       trains=True, offload_params=a.offload.params)


def ref_states(config: Config, s: Shape) -> Any:
    r = config.worker.ref
    return role_states(s.total_params, 0, shard_degree(r.fsdp.shard_size, s.world), trains=False,
                       offload_params=r.offload.params)


def _vision_grad(s: Shape) -> bool:
    return s.trainable.get("vision_tower", 0) > 0


def forward_peak(config: Config, s: Shape, hf_config: dict[str, Any], *, grad: bool, micro: MicroBatch,
                 role: str) -> dict[str, int]:
    """Transient bytes of one forward (+ backward) pass of ``micro`` on one device. Padded sequences keep the
    logits of their last ``response + 1`` positions; a padding-free one only those predicting its response
    tokens, each rank of a sequence-parallel group those of its chunk (an even share)."""
    dims = model_dims(hf_config)
    u = getattr(config.worker, role).ulysses_size
    eager = config.model.attn_implementation == "eager"
    acts = activation_bytes(dims, micro, s.dtype_bytes, grad=grad, checkpointing=config.model.gradient_checkpointing,
                            vision_grad=_vision_grad(s), eager=eager, ulysses=u)
    if config.worker.actor.padding_free:
        logits = logits_bytes(1, -(-micro.response // u), dims.vocab, s.dtype_bytes, grad=grad)
    else:
        logits = logits_bytes(micro.sequences, micro.response + 1, dims.vocab, s.dtype_bytes, grad=grad)
    return {"activations": acts, "logits": logits, "gathered": _gathered(config, s, hf_config, role, grad)}


def rollout_phase(config: Config, s: Shape, hf_config: dict[str, Any], capacity: Capacity,
                  validate: bool) -> dict[str, int]:
    """The rollout worker's device bytes while generating."""
    r, d = config.worker.rollout, config.data
    tp = r.tensor_parallel_size
    if r.engine == "vllm" and s.on_gpu:
        assert capacity.gpu_bytes is not None
        return {"vllm reservation": int(capacity.gpu_bytes * r.gpu_memory_utilization)}
    weights = s.total_params * s.dtype_bytes
    if r.engine == "vllm":  # CPU: weights + the KV space the engine is given (VLLM_CPU_KVCACHE_SPACE=1 GiB)
        return {"weights": weights, "kv cache": 2**30}
    n = r.val_override.n if validate else r.n
    prompts = (d.val_batch_size if validate and d.val_batch_size > 0 else d.rollout_batch_size)
    rows = -(-prompts * n // (s.world // tp))
    dims = model_dims(hf_config)
    kv = rows * s.seq_tokens * kv_bytes_per_token(hf_config, config.model.dtype)
    logits = 4 * rows * s.response * dims.vocab * s.dtype_bytes  # kept per step, stacked, scaled, log-softmax
    prefill = activation_bytes(dims, MicroBatch(rows, s.seq_tokens - s.response, 0, s.images, s.image_tokens),
                               s.dtype_bytes, grad=False, checkpointing=False, vision_grad=False)
    return {"weights": weights, "kv cache": kv, "logits": logits, "prefill": prefill}


def _rollout_idle(config: Config, s: Shape, capacity: Capacity) -> dict[str, int]:
    """What the rollout worker keeps on its device while the training roles work."""
    r = config.worker.rollout
    if r.engine == "vllm" and s.on_gpu:
        if r.sleep_level > 0 and config.trainer.colocate:
            return {}
        assert capacity.gpu_bytes is not None
        return {"vllm reservation": int(capacity.gpu_bytes * r.gpu_memory_utilization)}
    return {"rollout weights": s.total_params * s.dtype_bytes}


# ----------------------------------------------------------------------------- the plan


def plan(config: Config, hf_config: Optional[dict[str, Any]] = None, capacity: Optional[Capacity] = None) -> Plan:
    """The memory plan of ``config`` (its model's HF config is resolved when not given): the RL phases, or
    with ``trainer.task=sft`` the SFT ones (:mod:`easytrain.memory.sft`)."""
    from easytrain.models.shapes import hf_config_for

    hf_config = hf_config if hf_config is not None else hf_config_for(config.model)
    capacity = capacity or capacity_of(config)
    if config.trainer.task == "sft":
        return plan_sft(config, hf_config, capacity)
    s = shape_of(config, hf_config)
    actor, ref = actor_states(config, s), ref_states(config, s)
    upd_micro, accumulates = update_micro(config, s)

    idle = {"actor": {"actor params": actor.params if not actor.offloaded else 0,
                      "actor optimizer": actor.optimizer if not actor.offloaded else 0},
            "ref": ({"ref params": ref.device} if s.with_ref else {}),
            "rollout": _rollout_idle(config, s, capacity)}
    work: dict[str, tuple[str, dict[str, int]]] = {
        "generation": ("rollout", rollout_phase(config, s, hf_config, capacity, validate=False)),
        "validation": ("rollout", rollout_phase(config, s, hf_config, capacity, validate=True)),
    }
    if s.with_ref:
        work["ref_log_probs"] = ("ref", forward_peak(config, s, hf_config, grad=False,
                                                     micro=experience_micro(config, s, "ref"), role="ref"))
    if s.old_log_probs:
        work["old_log_probs"] = ("actor", forward_peak(config, s, hf_config, grad=False,
                                                       micro=experience_micro(config, s, "actor"), role="actor"))
    work["update"] = ("actor", update_transient(config, s, hf_config, upd_micro, accumulates,
                                                0 if actor.offloaded else actor.grads, actor.offloaded))
    work["weight_sync"] = ("actor", _sync_device(config, s, hf_config))

    rows = []
    for phase in PHASES:
        if phase not in work:
            continue
        role, active = work[phase]
        rows.append(_row(config, s, capacity, phase, role, active, idle, actor, ref))
    notes = [micro_note(config, s, upd_micro), *_notes(config, s, hf_config, capacity)]
    return Plan(rows, capacity, s.on_gpu, notes)


def update_transient(config: Config, s: Shape, hf_config: dict[str, Any], micro: MicroBatch, accumulates: bool,
                     grads: int, offloaded: bool) -> dict[str, int]:
    """The update's peak above the states: the end of a micro batch's forward (activations and logits;
    gradients too when accumulating) or the optimizer step (every gradient plus AdamW's two temporaries
    of the largest parameter shard, its sqrt and the denominator), whichever is larger."""
    passes = forward_peak(config, s, hf_config, grad=True, micro=micro, role="actor")
    passes["actor grads"] = grads if accumulates else 0
    degree = shard_degree(config.worker.actor.fsdp.shard_size, s.world)
    step = {"actor grads": grads,
            "optimizer temporaries": 0 if offloaded else 2 * -(-s.largest_trainable // degree) * FP32}
    return passes if sum_parts(passes) >= sum_parts(step) else step


def _sync_device(config: Config, s: Shape, hf_config: dict[str, Any]) -> dict[str, int]:
    """The weight sync: each actor rank's shard of a bucket on its way out; the rollout side assembles a
    bucket (on GPU into the woken engine's weights: vLLM level-2 sleep reloads weights first)."""
    bucket = int(config.worker.rollout.sync_bucket_mb * 2**20)
    parts = {"sync bucket": bucket}
    r = config.worker.rollout
    if r.engine == "vllm" and s.on_gpu and r.sleep_level > 0 and config.trainer.colocate:
        parts["rollout weights (woken)"] = -(-s.total_params // r.tensor_parallel_size) * s.dtype_bytes
    return parts


def _row(config: Config, s: Shape, capacity: Capacity, phase: str, role: str, active: dict[str, int],
         idle: dict[str, dict[str, int]], actor: Any, ref: Any) -> Row:
    roles = ["actor", "rollout"] + (["ref"] if s.with_ref else [])
    if config.trainer.colocate and s.on_gpu:  # one device holds every role's idle state plus the active role
        parts = {k: v for name in roles if name != role for k, v in idle[name].items()}
        parts.update(_working(role, active, idle))
        parts["cuda contexts"] = CUDA_CONTEXT_BYTES * len(roles)
    else:  # one device (CPU: one process) per role
        parts = _working(role, active, idle)
        if s.on_gpu:
            parts["cuda context"] = CUDA_CONTEXT_BYTES
    host_parts = _host(config, s, phase, role, active, idle, actor, ref, roles)
    return Row(phase, role, sum_parts(parts), sum_parts(host_parts), parts, host_parts)


def _working(role: str, active: dict[str, int], idle: dict[str, dict[str, int]]) -> dict[str, int]:
    """The working role's bytes: its states plus the phase's transients (the rollout's phase bytes
    already include its weights)."""
    return dict(active) if role == "rollout" else {**idle[role], **active}


def _host(config: Config, s: Shape, phase: str, role: str, active: dict[str, int], idle: dict[str, dict[str, int]],
          actor: Any, ref: Any, roles: list[str]) -> dict[str, int]:
    """Host RAM of one node in ``phase``: processes, offloaded states, on CPU every process's memory."""
    n = s.per_node
    d = config.data
    host = {"worker processes": FRAMEWORK_BYTES * n * len(roles),
            "driver, reward and loader processes": DRIVER_BYTES + FRAMEWORK_BYTES * (config.reward.num_workers
                                                                                     + d.num_workers)}
    offloaded = (actor.host if actor.offloaded else 0) + (ref.host if s.with_ref and ref.offloaded else 0)
    if offloaded:
        host["offloaded states"] = offloaded * n
    host["step batch (driver, object store, workers' shares)"] = 3 * batch_bytes(config, s)
    if phase == "weight_sync":
        bucket = int(config.worker.rollout.sync_bucket_mb * 2**20)
        host["sync buckets (object store + assembly)"] = 2 * bucket + n * bucket
    if not s.on_gpu:  # every process's device bytes are this node's RAM
        for name in roles:
            held = _working(role, active, idle) if name == role else idle[name]
            host[f"{name} workers"] = n * sum_parts(held)
    return host


def batch_bytes(config: Config, s: Shape) -> int:
    """A step's batch as the driver holds it: per sequence the ids, masks, 3-D positions and token types
    (int64) over the whole sequence, the per-token response tensors (ids, mask, three log-probs, advantages),
    and the pixel values of its images (each of a prompt's n samples carries its own copy)."""
    sequences = config.data.rollout_batch_size * config.worker.rollout.n
    per_sequence = s.seq_tokens * 8 * 6 + s.response * (8 + 8 + 4 * 4)
    pixels = s.images * s.image_tokens * 4 * PATCH_VALUES * FP32
    return sequences * (per_sequence + pixels)


def micro_note(config: Config, s: Shape, micro: MicroBatch) -> str:
    """The actor's and reference's micro batch shape, in words."""
    a = config.worker.actor
    images = f", {micro.images} image(s) of {micro.image_tokens} tokens" if micro.images else ""
    if not a.padding_free:
        return (f"micro batch: update {micro.sequences} sequence(s) x {micro.tokens} tokens (max_prompt_length + "
                f"max_response_length{images} each), log-probs {experience_micro(config, s, 'actor').sequences} "
                "sequence(s) of the same shape, padded")
    samples = micro.response // max(1, s.response)
    split = (f"; each of worker.actor.ulysses_size={a.ulysses_size} ranks holds 1/{a.ulysses_size} of its "
             "activations and logits" if a.ulysses_size > 1 else "")
    return (f"micro batch: one padding-free sequence of {micro.tokens} tokens (max_token_len_per_device: "
            f"{samples} full-length sample(s){images}, logits at their {micro.response} response positions) for the "
            f"update and the log-prob passes; the {per_rank(config, s, 'actor', a.global_batch_size)} sequences of "
            f"a data-parallel rank per optimizer step packed into as many as they need{split}")


def _notes(config: Config, s: Shape, hf_config: dict[str, Any], capacity: Capacity) -> list[str]:
    r = config.worker.rollout
    notes = []
    if r.engine == "vllm" and s.on_gpu and capacity.gpu_bytes:
        budget = engine_budget(capacity.gpu_bytes, r.gpu_memory_utilization, s.total_params, hf_config,
                               config.model.dtype, r.tensor_parallel_size, s.seq_tokens)
        engines = s.world // r.tensor_parallel_size
        want = -(-config.data.rollout_batch_size * r.n // engines)
        notes.append(f"vLLM: {budget.weights / GB:.1f} GB weights per GPU, {budget.kv_cache / GB:.1f} GB KV cache "
                     f"= {budget.max_sequences} sequences of {s.seq_tokens} tokens at once per engine "
                     f"({want} requested per engine per step)")
        if budget.kv_cache == 0:
            notes.append("vLLM: the weights do not fit in gpu_memory_utilization x GPU: no room for a KV cache")
    batch = batch_bytes(config, s)
    if batch > GB:
        pixels = config.data.rollout_batch_size * r.n * s.images * s.image_tokens * 4 * PATCH_VALUES * FP32
        notes.append(f"step batch: {batch / GB:.1f} GB per copy, {pixels / GB:.1f} GB of it pixel values "
                     f"({s.images} image(s) of {s.image_tokens} tokens per sequence, each of the n={r.n} samples "
                     "of a prompt carrying its own copy)")
    if not s.on_gpu:
        notes.append("CPU run: roles are processes in node RAM; offload moves nothing")
    return notes


def worker_bytes(config: Config, role: str, phase: str, hf_config: Optional[dict[str, Any]] = None) -> int:
    """Predicted bytes of one ``role`` worker process in ``phase`` on CPU, above an empty worker process
    (what bench/planner_accuracy.py measures): its states, its share of the step batch and the phase's
    transients. These are live bytes: glibc's default malloc also keeps freed blocks below its (growing)
    mmap threshold in RSS, and the runtime's own scratch space is not counted."""
    return sum(worker_parts(config, role, phase, hf_config).values())


def worker_parts(config: Config, role: str, phase: str, hf_config: Optional[dict[str, Any]] = None) -> dict[str, int]:
    """:func:`worker_bytes` by part (SFT: the actor in ``setup``, ``forward_backward``, ``optimizer`` or
    ``validate``; ``update`` means ``forward_backward``)."""
    from easytrain.models.shapes import hf_config_for

    hf_config = hf_config if hf_config is not None else hf_config_for(config.model)
    if config.trainer.task == "sft":
        return sft_worker_parts(config, phase, hf_config)
    s = shape_of(config, hf_config)
    states = actor_states(config, s) if role == "actor" else ref_states(config, s)
    parts = {"params": states.params, "optimizer": states.optimizer,
             "batch share": batch_bytes(config, s) // s.world}
    if phase == "update":
        micro, accumulates = update_micro(config, s)
        transient = update_transient(config, s, hf_config, micro, accumulates, states.grads, False)
    else:
        transient = forward_peak(config, s, hf_config, grad=False, micro=experience_micro(config, s, role),
                                 role=role)
    parts.update(transient)
    return parts
