"""The memory plan: bytes per GPU and per node for every role in every phase, before anything starts.

``plan(config)`` prices each phase of an RL step (generation, reference log-probs,
old log-probs, update, weight sync, then validation) in the order the driver
runs them on a shared device (:data:`easytrain.memory.phases.STEP`), from the
composed config and the model's HF config alone: the role that works in the
phase holds its states plus its transient peak (gathered FSDP units,
activations, logits, KV cache), the others hold what they keep between
phases, and the rollout engine what the phase's engine state leaves it
(:mod:`easytrain.memory.layout`: awake, weights only, or asleep at its sleep
level). With ``trainer.colocate=true`` the workers are fused: one process per
device hosts every role, with one CUDA context, and a device's peak is its
largest phase, not the sum of roles. With ``colocate=false`` every role has
its own process and device. On CPU the "device" is one worker process in
the node's RAM, and the node total adds up every process. Before the first
step the models load (``Plan.once``, with the checkpoint save, the resume and
the export: :mod:`easytrain.memory.host`): one whole fp32 checkpoint per node
in host RAM, the shards where each role keeps them. Host RAM is every
process's resident set (:mod:`easytrain.memory.host`). An SFT run
(``trainer.task=sft``) is planned by :mod:`easytrain.memory.sft`: its one
role, the actor, in its own phases.

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

With ``worker.actor.share_prompt`` (sdpa or eager attention, no sequence
parallelism: :mod:`easytrain.workers.shared_prompt`) the passes lay each
prompt out once followed by its responses, and are priced so
(:func:`easytrain.memory.rl_shape.shared_micro`): padded, a row per prompt the micro batch touches
(at most one more than its whole groups when it straddles prompts), as
long as the longest such row, when that layout pays off by the workers' own
rule; padding-free, whole prompts with their n responses packed into the
token budget (the driver's prompt-aware plan), when one fits.

Assumptions (the per-process ones in :mod:`easytrain.memory.capacity`): vLLM
reserves ``gpu_memory_utilization`` x the GPU while awake and, in sleep
level 2, frees all of it between rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from easytrain.config.schema import Config
from easytrain.memory.activations import MicroShape, logits_bytes, model_dims
from easytrain.memory.budget import engine_budget, kv_bytes_per_token
from easytrain.memory.capacity import (CUDA_CONTEXT_BYTES, GB, Capacity, Plan, Row, capacity_of, gpu_process_device,
                                       sum_parts)
from easytrain.memory.host import (batch_pages, batches_in_flight, heap_keeps_freed, maps_checkpoint,
                                   node_host, pass_activations, received_batch, run_phases, store_pages,
                                   worker_process)
from easytrain.memory.layout import (engine_held, engine_weights, fused, layout_note, processes_per_device,
                                     role_names, step_phases, sync_bucket, sync_parts)
from easytrain.memory.sft import plan_sft, sft_worker_parts, validation_prompts
from easytrain.memory.states import FP32, role_states, shard_degree
from easytrain.memory.phases import Phase
from easytrain.config.presets import RANDOM_PREFIX
from easytrain.models.families import family_of
from easytrain.memory.data_shape import DataCosts
from easytrain.memory.rl_shape import Shape, experience_micro, gathered_units, packed_group, per_rank, shape_of, update_micro

__all__ = ["CUDA_CONTEXT_BYTES", "GB", "Capacity", "Plan", "Row", "capacity_of", "plan", "worker_bytes",
           "worker_parts", "shape_of", "update_transient"]

PHASES = ("generation", "ref_log_probs", "old_log_probs", "update", "weight_sync", "validation")
"""The plan's rows of a step (and validation); they run in :data:`easytrain.memory.phases.STEP`'s order."""


# ----------------------------------------------------------------------------- per role


def actor_states(config: Config, s: Shape) -> Any:
    """The actor's per-device states. Offloading moves them from a GPU to host RAM; on CPU the device is the
    host, so offloaded or not they are the worker's own memory and are priced as held."""
    a = config.worker.actor
    return role_states(s.total_params, sum(s.trainable.values()), shard_degree(a.fsdp.shard_size, s.world),
                       trains=True, offload_params=a.offload.params and s.on_gpu)


def ref_states(config: Config, s: Shape) -> Any:
    r = config.worker.ref
    return role_states(s.total_params, 0, shard_degree(r.fsdp.shard_size, s.world), trains=False,
                       offload_params=r.offload.params and s.on_gpu)


def _vision_grad(s: Shape) -> bool:
    return s.trainable.get("vision_tower", 0) > 0


def forward_peak(config: Config, s: Shape, hf_config: dict[str, Any], *, grad: bool, micro: MicroShape,
                 role: str, adapters: bool = True) -> dict[str, int]:
    """Transient bytes of one forward (+ backward) pass of ``micro`` on one device. Padded sequences keep the
    logits of their last ``response + 1`` positions; a padding-free one only those predicting its response
    tokens, each rank of a sequence-parallel group those of its chunk (an even share). ``adapters``: whether the
    pass runs a LoRA model's adapters (the reference pass of a LoRA actor turns them off)."""
    dims = model_dims(hf_config)
    u = getattr(config.worker, role).ulysses_size
    eager = config.model.attn_implementation == "eager"
    acts = pass_activations(config, "activations", dims, micro, s.dtype_bytes, s.on_gpu, adapters, grad=grad,
                            checkpointing=config.model.gradient_checkpointing, vision_grad=_vision_grad(s),
                            eager=eager, ulysses=u)
    if config.worker.actor.padding_free:
        logits = logits_bytes(1, -(-micro.response // u), dims.vocab, s.dtype_bytes, grad=grad)
    else:
        logits = logits_bytes(micro.sequences, micro.response + 1, dims.vocab, s.dtype_bytes, grad=grad)
    return {**acts, "logits": logits, "gathered": gathered_units(config, s, hf_config, role, grad)}


def rollout_phase(config: Config, s: Shape, hf_config: dict[str, Any], capacity: Capacity,
                  validate: bool) -> dict[str, int]:
    """The rollout worker's device bytes while generating (``validate``: the validation prompts')."""
    r, d = config.worker.rollout, config.data
    s = s.validation if validate else s
    tp = r.tensor_parallel_size
    if r.engine == "vllm" and s.on_gpu:
        assert capacity.gpu_bytes is not None
        return {"vllm reservation": int(capacity.gpu_bytes * r.gpu_memory_utilization)}
    weights = s.total_params * s.dtype_bytes
    if r.engine == "vllm":  # CPU: weights + the KV space the engine is given (VLLM_CPU_KVCACHE_SPACE=1 GiB)
        return {"weights": weights, "kv cache": 2**30}
    n = r.val_override.n if validate else r.n
    prompts = validation_prompts(config, d.rollout_batch_size) if validate else d.rollout_batch_size
    rows = -(-prompts * n // (s.world // tp))
    dims = model_dims(hf_config)
    kv = rows * s.seq_tokens * kv_bytes_per_token(hf_config, config.model.dtype)
    reuses_kv = family_of(hf_config).unsupported("kv_reuse") is None  # easytrain's decode loops, else generate
    if reuses_kv:  # the decode loop: one position's logits at a time (fp32 copy, scaled, log-softmax)
        logits = 4 * rows * dims.vocab * FP32
    else:  # transformers' generate: every position's logits kept, stacked, scaled, log-softmax
        logits = 4 * rows * s.response * dims.vocab * s.dtype_bytes
    # the decode loop prefills each prompt once for its n samples
    prefill_rows = -(-prompts // (s.world // tp)) if reuses_kv and n > 1 else rows
    prompt = MicroShape(prefill_rows, s.seq_tokens - s.response, 0, s.images, s.image_tokens)
    return {"weights": weights, "kv cache": kv, "logits": logits,
            **pass_activations(config, "prefill", dims, prompt, s.dtype_bytes, s.on_gpu, adapters=False, grad=False,
                               checkpointing=False, vision_grad=False)}


def engine_resident(config: Config, s: Shape, awake: dict[str, int]) -> dict[str, int]:
    """What an engine that never sleeps keeps on its device between rollouts: vLLM its reservation (on CPU its
    weights and KV space), the HF engine its weights (its KV cache lives only while it generates)."""
    if config.worker.rollout.engine == "vllm":
        return dict(awake)
    return {"rollout weights": s.total_params * s.dtype_bytes}


# ----------------------------------------------------------------------------- the plan


OVERLAPPED = ("ref_log_probs", "old_log_probs", "update")
"""The actor's phases the rollout pool generates beside with ``trainer.rollout_mode=one_step_off`` (or async)."""
QUEUE = "async queue (driver)"
"""``trainer.rollout_mode=async``: the queue of finished samples, at its bound (``trainer.async_queue_gb``)."""


@dataclass(frozen=True)
class _Step:
    """What every row of the plan reads: the roles' states and what each keeps between phases."""

    config: Config
    s: Shape
    actor: Any
    ref: Any
    idle: dict[str, dict[str, int]]
    """What the actor and the reference keep on their device between their phases."""
    awake: dict[str, int]
    """The engine while generating (the training step's sampling)."""
    resident: dict[str, int]
    engine_weights: int
    mapped: dict[str, dict[str, int]]
    """Split pools: what the sync through Ray's object store leaves mapped in every actor and rollout process
    from its first sync on, by role (:func:`object_store_pages`)."""


def plan(config: Config, hf_config: Optional[dict[str, Any]] = None, capacity: Optional[Capacity] = None,
         data: Optional[DataCosts] = None) -> Plan:
    """The memory plan of ``config`` (its model's HF config is resolved when not given): the RL phases in the
    order they run, or with ``trainer.task=sft`` the SFT ones (:mod:`easytrain.memory.sft`). ``data``: the
    sequences priced from the data's rows (:mod:`easytrain.memory.data_shape`), not at the limits."""
    from easytrain.models.shapes import hf_config_for

    hf_config = hf_config if hf_config is not None else hf_config_for(config.model)
    capacity = capacity or capacity_of(config)
    if config.trainer.task == "sft":
        return plan_sft(config, hf_config, capacity)
    s = shape_of(config, hf_config, data)
    actor, ref = actor_states(config, s), ref_states(config, s)
    upd_micro, accumulates = update_micro(config, s)
    awake = rollout_phase(config, s, hf_config, capacity, validate=False)
    bucket = sync_bucket(config, s.largest_module, s.total_params, s.dtype_bytes)
    step = _Step(config, s, actor, ref,
                 idle={"actor": {"actor params": actor.params if not actor.offloaded else 0,
                                 "actor optimizer": actor.optimizer if not actor.offloaded else 0},
                       "ref": ({"ref params": ref.device} if s.with_ref else {})},
                 awake=awake, resident=engine_resident(config, s, awake),
                 engine_weights=engine_weights(config, s.total_params, s.dtype_bytes),
                 mapped={role: object_store_pages(config, s, role) for role in ("actor", "rollout")})
    work: dict[str, tuple[str, dict[str, int]]] = {
        "generation": ("rollout", awake),
        "validation": ("rollout", rollout_phase(config, s, hf_config, capacity, validate=True)),
    }
    if s.with_ref or s.ref_by_actor:
        by = "ref" if s.with_ref else "actor"  # LoRA: the actor with its adapters disabled
        work["ref_log_probs"] = (by, forward_peak(config, s, hf_config, grad=False,
                                                  micro=experience_micro(config, s, by), role=by, adapters=False))
    if s.old_log_probs:
        work["old_log_probs"] = ("actor", forward_peak(config, s, hf_config, grad=False,
                                                       micro=experience_micro(config, s, "actor"), role="actor"))
    work["update"] = ("actor", update_transient(config, s, hf_config, upd_micro, accumulates,
                                                0 if actor.offloaded else actor.grads, actor.offloaded))
    # every bucket a sync gathered stays in a CPU worker's heap until the call returns (heap_keeps_freed); one
    # process gathers nothing (its tensors go to the engine as they are): only a bucket's LoRA merges or casts
    # are new, freed before the next bucket reuses their heap; split pools put shards as they are: no gather
    kept = heap_keeps_freed(config, s.on_gpu) and fused(config) and s.world > 1
    gathered = max(bucket, s.total_params * s.dtype_bytes) if kept else bucket
    work["weight_sync"] = ("actor", _unsplit_sync(config, s) if _unsplit(config, s) else
                           sync_parts(config, gathered, s.per_node)[0])
    phases = list(step_phases(set(work)))
    rows = [_row(step, p, *work[p.planned]) for p in phases]
    notes = [layout_note(config, s.with_ref, s.ref_by_actor, s.on_gpu, set(work)),
             micro_note(config, s, upd_micro), *_notes(config, s, hf_config, capacity)]
    once = [_load_row(step), *_run_rows(step, capacity)]
    planned = Plan(rows, capacity, s.on_gpu, notes, once=once, data=data)
    if config.trainer.rollout_mode == "async":
        planned.notes.append(planned.queue_note(config.trainer.async_queue_gb))
    return planned


def object_store_pages(config: Config, s: Shape, role: str) -> dict[str, int]:
    """Split pools: the object store's pages a weight sync wrote (an actor rank: its shards) and read (a rollout
    rank: every bucket whole), resident in each of those processes from the first sync on, the store placing one
    sync's buckets side by side (measured on CPU: the ~184M bench model in split pools, bench/results/planner_accuracy.json
    calibration row mid_rl_split, each process ~0.7 GB above its own tensors from the first sync on). Shared
    pages: the node's used memory counts them once, the processes' RSS each time (the plan's sum, on the safe
    side)."""
    if fused(config):
        return {}
    whole = s.total_params * s.dtype_bytes
    return {"object store pages (weight sync)": -(-whole // s.world) if role == "actor" else whole}


def update_transient(config: Config, s: Shape, hf_config: dict[str, Any], micro: MicroShape, accumulates: bool,
                     grads: int, offloaded: bool) -> dict[str, int]:
    """The update's peak above the states: the end of a micro batch's forward (activations and logits;
    gradients too when accumulating) or the optimizer step (every gradient plus AdamW's two temporaries
    of the largest parameter shard, its sqrt and the denominator), whichever is larger. Their sum on a CPU
    worker under glibc's dynamic mmap threshold (the default; :func:`heap_keeps_freed`), which keeps the passes'
    freed blocks resident through the step."""
    passes = forward_peak(config, s, hf_config, grad=True, micro=micro, role="actor")
    passes["actor grads"] = grads if accumulates else 0
    degree = shard_degree(config.worker.actor.fsdp.shard_size, s.world)
    temporaries = 2 * -(-s.largest_trainable // degree) * FP32
    if heap_keeps_freed(config, s.on_gpu):  # the passes' freed blocks stay resident through the step
        kept = {**passes, "actor grads": grads, "optimizer temporaries": temporaries}
        if accumulates and degree > 1:  # FSDP: each micro batch's sum of gradient shards replaces the last one,
            kept["actor grads (freed, kept by the heap)"] = grads  # which the heap keeps (unsharded: added in place)
        return kept
    step = {"actor grads": grads, "optimizer temporaries": 0 if offloaded else temporaries}
    return passes if sum_parts(passes) >= sum_parts(step) else step


def _row(st: _Step, phase: Phase, role: str, active: dict[str, int]) -> Row:
    """One phase's row. Fused (colocated): the device's one process holds every role's idle states, the
    working role's bytes, the engine as the phase leaves it and one CUDA context. Otherwise the working
    role's own device (CPU: process) holds its bytes alone."""
    s = st.s
    engine, engine_host = ((dict(active), {}) if role == "rollout" else
                           engine_held(st.config, phase.engine, st.awake, st.resident, st.engine_weights, s.on_gpu))
    if fused(st.config):
        parts = {k: v for name in ("actor", "ref") if name != role for k, v in st.idle[name].items()}
        if role != "rollout":
            parts.update({**st.idle[role], **active})
        parts.update(engine)
    else:
        parts = dict(active) if role == "rollout" else {**st.idle[role], **active}
    if s.on_gpu:
        parts.update(gpu_process_device(phase.planned))
    host_parts, process = _host(st, phase, role, active, parts, engine_host)
    return Row(phase.planned, role, sum_parts(parts), sum_parts(host_parts), parts, host_parts, sum_parts(process))


def _offloaded(st: _Step) -> dict[str, int]:
    """What one worker process keeps in host RAM on a GPU node: its roles' offloaded states."""
    out = {}
    if st.actor.offloaded:
        out["actor states (offloaded)"] = st.actor.host
    if st.s.with_ref and st.ref.offloaded:
        out["ref params (offloaded)"] = st.ref.host
    return out


def _host(st: _Step, phase: Phase, role: str, active: dict[str, int], device: dict[str, int],
          engine_host: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(node, busiest worker process) host bytes in ``phase`` (:mod:`easytrain.memory.host`): the workers, the
    other processes, the step batch, the sync's transport across processes. On CPU a worker's tensors are all
    in its RSS; on a GPU node its offloaded states and an asleep engine's weights (level 1)."""
    s, config, n, name = st.s, st.config, st.s.per_node, phase.planned
    extra = batches_in_flight(batch_bytes(config, s, validate=name == "validation"), paged(config, s, name))
    if config.trainer.rollout_mode == "async" and config.trainer.async_queue_gb > 0:
        extra[QUEUE] = int(config.trainer.async_queue_gb * 1e9)  # the driver holds it through every phase
    if name == "weight_sync":
        extra.update(sync_parts(config, sync_bucket(config, s.largest_module, s.total_params, s.dtype_bytes), n)[1])
    if fused(config):
        held = dict(device) if not s.on_gpu else {**_offloaded(st), **engine_host}
        process = worker_process(name, {**held, **batch_pages(paged(config, s.ranked, name), s.world),
                                        **received_batch(call_batch(config, s.ranked, name), s.world)}, s.on_gpu)
        return node_host(config, name, [(n, process)], True, extra), process
    # one step off, the rollout pool generates the next batch while the actor's phases run: both at once
    generating = config.trainer.rollout_mode in ("one_step_off", "async") and name in OVERLAPPED
    workers, process = [], {}
    for other in role_names(s.with_ref):
        if s.on_gpu:
            held = {k: v for k, v in _offloaded(st).items() if k.startswith(other)}
        elif other == role:
            held = dict(active) if role == "rollout" else {**st.idle[role], **active}
        elif other == "rollout":
            held = dict(st.awake if generating else st.resident)
        else:
            held = dict(st.idle[other])
        held.update({**st.mapped.get(other, {}), **batch_pages(paged(config, s.ranked, name, other), s.world)})
        if other == role:
            held.update(received_batch(call_batch(config, s.ranked, name), s.world))
        busy = other == role or (other == "rollout" and generating)
        one = worker_process(name if other == role else "generation" if busy else "idle", held, s.on_gpu)
        workers.append((n, one))
        if other == role:
            process = one
    return node_host(config, name, workers, True, extra), process


def _load_row(st: _Step) -> Row:
    """The models' load, before the first step: the roles' parameter shards where they keep them and the engine
    as it is built, on one device (fused) or the fullest role's; in host RAM the worker processes with their
    host-resident shards and, sharded over several ranks, the whole fp32 checkpoint rank 0 reads (one per
    node: :mod:`easytrain.distributed.load`)."""
    s, config = st.s, st.config
    shards = {"actor params": st.actor.params, "ref params": st.ref.params if s.with_ref else 0}
    on_device = {"actor params": 0 if st.actor.offloaded else shards["actor params"],
                 "ref params": 0 if st.ref.offloaded else shards["ref params"]}
    if fused(config):
        parts = {**on_device, **st.resident}
    else:
        parts = max(({"actor params": on_device["actor params"]}, {"ref params": on_device["ref params"]},
                     dict(st.resident)), key=sum_parts)
    if s.on_gpu:
        parts.update(gpu_process_device("load"))
    # on CPU one rank that copies its parameters out of the checkpoint (offloaded or cast: FSDP's own shards)
    # holds the file's pages it read beside the copy until the load returns (measured: the ~184M model offloaded
    # on one rank, held-out seed 3's s3_19, 2.0 GB while loading: twice the fp32 model over the framework)
    lazy = {"actor params": _maps_checkpoint(config, s, "actor"), "ref params": _maps_checkpoint(config, s, "ref")}
    copied = (not s.on_gpu and not config.model.path.startswith(RANDOM_PREFIX)
              and any(v and not lazy[k] for k, v in on_device.items()))
    whole = {"checkpoint read (whole, fp32, rank 0)": s.total_params * FP32} if s.world > 1 or copied else {}
    if s.on_gpu and not config.model.path.startswith(RANDOM_PREFIX):
        # the reading process holds the file's pages, and the engine's weights pass through host RAM in the
        # compute dtype on their way to the device (measured: the ~0.6B model's load on an H200,
        # bench/gpu_smoke.py's run half_b_bf16, phase load: a calibration row; host readings not kept in its results)
        whole = {"checkpoint read (whole, fp32, rank 0)": s.total_params * FP32,
                 "engine weights (host, on their way to the device)":
                     s.total_params * s.dtype_bytes if s.dtype_bytes != FP32 and fused(config) else 0}
    offloaded = {f"{k} (offloaded)": v for k, v in shards.items() if v and on_device[k] == 0}
    # on CPU a role that is not sharded (one rank) and not copied keeps the checkpoint file's pages mapped, as the
    # rollout engine does: not resident until a pass first reads them (measured: the ~184M bench model on one rank,
    # calibration row mid_rl_split, 0.54 GB per process while loading)
    if fused(config):
        # on CPU an engine's weights are the checkpoint file's pages, mapped: resident once the engine first runs
        held = {k: v for k, v in on_device.items() if v and not lazy[k]} if not s.on_gpu else offloaded
        if not s.on_gpu and lazy["actor params"] and config.model.lora.rank > 0:  # built in memory, not mapped
            held["actor LoRA adapters"] = sum(s.trainable.values()) * FP32
        one = worker_process("load", held, s.on_gpu)
        # rank 0 reads the whole checkpoint and shards it before its engine is built: the larger of the two
        reader = worker_process("load", {**{k: v for k, v in held.items() if "params" in k}, **whole}, s.on_gpu)
        first = max(one, reader, key=sum_parts)
        host = node_host(config, "load", [(1, first), (s.per_node - 1, one)], True)
        return Row("load", "all", sum_parts(parts), sum_parts(host), parts, host, sum_parts(first))
    else:
        workers, one = [], {}
        for name, held in (("actor", on_device["actor params"]), ("ref", on_device["ref params"]),
                           ("rollout", 0 if not s.on_gpu else sum_parts(st.resident))):
            if name == "ref" and not s.with_ref:
                continue
            held = 0 if lazy.get(f"{name} params") else held
            kept = ({f"{name} shards": held} if not s.on_gpu else
                    {k: v for k, v in offloaded.items() if k.startswith(name)})
            process = worker_process("load", kept, s.on_gpu)
            workers.append((s.per_node, process))
            one = max(one, process, key=sum_parts)
    host = node_host(config, "load", workers, True, whole)
    return Row("load", "all" if fused(config) else "each", sum_parts(parts), sum_parts(host), parts, host,
               sum_parts(one) + sum_parts(whole))


def _unsplit(config: Config, s: Shape) -> bool:
    """Whether the sync copies the actor's weights into the engine's where they lie, without gathering, and
    without a cast: one fused process without LoRA (:func:`easytrain.workers.weight_sync.unsplit`) whose engine
    dtype is the fp32 of its master weights, or a vLLM engine (which takes nothing in place)."""
    one = fused(config) and s.world == 1 and config.model.lora.rank == 0
    return one and (s.dtype_bytes == FP32 or config.worker.rollout.engine == "vllm")


def _unsplit_sync(config: Config, s: Shape) -> dict[str, int]:
    """The one-process sync's transient: in fp32 nothing (the HF engine takes every weight in place, vLLM's
    ``load_weights`` gets the master tensors themselves); vLLM in another dtype gets the whole model cast. (The
    HF engine cast to bf16 is priced as a gathered bucket: torch's peak in that sync on one H200 held about one
    bucket beside the weights, bench/results/gpu_smoke.json.)"""
    if s.dtype_bytes == FP32:
        return {}
    return {"engine-dtype copy (whole model, to load_weights)": s.total_params * s.dtype_bytes}


def _maps_checkpoint(config: Config, s: Shape, role: str) -> bool:
    """:func:`easytrain.memory.host.maps_checkpoint` for ``role``."""
    return maps_checkpoint(config, s.on_gpu, s.world, s.dtype_bytes, getattr(config.worker, role).offload.params)


def _run_rows(st: _Step, capacity: Capacity) -> list[Row]:
    """Checkpoint save, resume load and export (:func:`easytrain.memory.host.run_phases`)."""
    s = st.s
    others: dict[str, list[tuple[int, dict[str, int]]]] = {}
    if fused(st.config):
        resumed = {**st.idle["actor"], **st.idle["ref"]}
        kept = {**resumed, **st.resident}
    else:  # the actor processes save and resume; the reference and the engine wait in their own processes
        resumed = dict(st.idle["actor"])
        kept = {**resumed, **st.mapped["actor"]}
        saved = {role: batch_pages(paged(st.config, s.ranked, "checkpoint_save", role), s.world)
                 for role in ("rollout", "ref")}
        ref = [(s.per_node, dict(st.idle["ref"]))] if s.with_ref else []
        # resumed before any sync: the engine's weights are still the checkpoint file's pages, not resident
        others = {"checkpoint_save": [(s.per_node, {**st.resident, **st.mapped["rollout"], **saved["rollout"]}),
                                      *([(s.per_node, {**st.idle["ref"], **saved["ref"]})] if s.with_ref else [])],
                  "resume_load": [(s.per_node, {}), *ref]}
    device = {**kept, **gpu_process_device("checkpoint_save")} if s.on_gpu else dict(kept)
    if s.on_gpu:
        kept = resumed = _offloaded(st)
        others = {phase: [(n, {k: v for k, v in _offloaded(st).items() if k.startswith(("ref", "rollout"))})
                          for n, _ in rest] for phase, rest in others.items()}
    degree = shard_degree(st.config.worker.actor.fsdp.shard_size, s.world)
    saver = "fused" if fused(st.config) else "actor"
    saver_pages = sum(batch_pages(paged(st.config, s.ranked, "checkpoint_save", saver), s.world).values())
    return run_phases(st.config, kept=kept, resumed=resumed, others=others,
                      state=st.actor.params + st.actor.optimizer,
                      trainable=st.actor.grads,  # the trainable shards in fp32: what their gradients take
                      largest_tensor=s.largest_module, largest_shard=-(-s.largest_module // degree) * FP32,
                      total_params=s.total_params, per_node=s.per_node,
                      processes_per_node=s.per_node * processes_per_device(st.config, s.with_ref),
                      savers_per_node=s.per_node, saver_pages=saver_pages,
                      driver_pages=paged(st.config, s, "checkpoint_save"),
                      node_ram=capacity.node_ram, on_gpu=s.on_gpu, rl=True, device=device)


def step_calls(config: Config, s: Shape) -> dict[str, list[int]]:
    """The batches each role's calls of a step receive (bytes, all its ranks together): the engine's generate
    the prompts (ids, masks, positions; pixels once per prompt), the reference's log-prob pass, and the actor's
    (the reference's too with LoRA, old log-probs, update) the step's batch (:func:`batch_bytes`)."""
    batch = batch_bytes(config, s)
    prompts = config.data.rollout_batch_size
    return {"rollout": [prompts * (s.seq_tokens - s.response) * 8 * 3 + s.batch_vision * s.values_per_token * FP32],
            "ref": [batch] if s.with_ref else [],
            "actor": [batch] * (1 + s.old_log_probs + s.ref_by_actor)}


def paged(config: Config, s: Shape, phase: str, role: str = "") -> int:
    """The object store's pages the batches of ``role``'s calls went through by ``phase``
    (:func:`easytrain.memory.host.store_pages`): the engine's with the validations; ``fused``, one process's
    calls for every role; by default every call's (the driver writes them all)."""
    calls = step_calls(config, s)
    roles = {"fused": list(calls), "": list(calls)}.get(role, [role])
    validation = batch_bytes(config, s, validate=True) if "rollout" in roles else 0
    return store_pages(config, phase, [b for r in roles for b in calls[r]], validation)


def call_batch(config: Config, s: Shape, phase: str) -> int:
    """The batch the call of ``phase`` receives (bytes, all ranks together) beyond what its passes price as their
    input: a log-prob pass or the update receives the step's batch, of which one micro batch's pixels are the
    pass's input (:func:`forward_peak`); generate and a validation run their prefill over all the rank's prompts,
    whose pixels the prefill prices; a weight sync or a save receives none."""
    if phase not in ("ref_log_probs", "old_log_probs", "update"):
        return 0
    micro = update_micro(config, s)[0] if phase == "update" else experience_micro(
        config, s, "ref" if phase == "ref_log_probs" and not s.ref_by_actor else "actor")
    pixels = micro.sequences * micro.images * micro.image_tokens * s.values_per_token * FP32
    return max(0, batch_bytes(config, s) - min(pixels * s.world, s.batch_vision * s.values_per_token * FP32))


def batch_bytes(config: Config, s: Shape, validate: bool = False) -> int:
    """A step's batch as the driver holds it: per sequence the ids, masks, 3-D positions and token types (int64)
    over the whole sequence, the per-token response tensors (ids, mask, three log-probs, advantages), and its
    prompts' pixel values, once per prompt (a prompt's n samples share them: ``distributed.batch.Pixels``).
    ``validate``: a validation call's prompts (their ids, masks, positions and pixels) and the response tokens
    that come back (ids, mask, log-probs; the pixels stay with the engine). The prompts' pixels are
    :attr:`Shape.batch_vision`'s."""
    if validate:
        s = s.validation
        pixels = s.batch_vision * s.values_per_token * FP32
        prompts = validation_prompts(config, config.data.rollout_batch_size)
        samples = prompts * config.worker.rollout.val_override.n
        return prompts * (s.seq_tokens - s.response) * 8 * 3 + pixels + samples * s.response * (8 + 8 + 4)
    pixels = s.batch_vision * s.values_per_token * FP32
    prompts = config.data.rollout_batch_size
    per_sequence = s.seq_tokens * 8 * 6 + s.response * (8 + 8 + 4 * 4)
    return prompts * config.worker.rollout.n * per_sequence + pixels


def micro_note(config: Config, s: Shape, micro: MicroShape) -> str:
    """The actor's and reference's micro batch shape, in words."""
    a = config.worker.actor
    images = f", {micro.images} image(s) of {micro.image_tokens} tokens" if micro.images else ""
    if not a.padding_free:
        experience = experience_micro(config, s, "actor")
        shared = micro.tokens != s.seq_tokens or experience.tokens != s.seq_tokens
        if shared:
            return (f"micro batch, prompt-shared (worker.actor.share_prompt): update {micro.sequences} row(s) x "
                    f"{micro.tokens} tokens (a prompt once, then {micro.response // max(1, s.response)} responses"
                    f"{images}), log-probs {experience.sequences} row(s) x {experience.tokens} tokens, padded")
        return (f"micro batch: update {micro.sequences} sequence(s) x {micro.tokens} tokens (max_prompt_length + "
                f"max_response_length{images} each), log-probs {experience.sequences} "
                "sequence(s) of the same shape, padded")
    group = packed_group(config, s, a.global_batch_size, "actor")
    if group is not None:
        units = micro.response // max(1, config.worker.rollout.n * s.response)
        what = (f"{units} prompt(s) once each with their n={config.worker.rollout.n} responses "
                f"({group} tokens a prompt, share_prompt){images}")
    else:
        what = f"{micro.response // max(1, s.response)} full-length sample(s){images}"
    split = (f"; each of worker.actor.ulysses_size={a.ulysses_size} ranks holds 1/{a.ulysses_size} of its "
             "activations and logits" if a.ulysses_size > 1 else "")
    return (f"micro batch: one padding-free sequence of {micro.tokens} tokens (max_token_len_per_device: "
            f"{what}, logits at their {micro.response} response positions) for the "
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
        pixels = s.batch_vision * s.values_per_token * FP32
        notes.append(f"step batch: {batch / GB:.1f} GB per copy, {pixels / GB:.1f} GB of it pixel values "
                     f"({s.batch_vision} vision tokens over its {config.data.rollout_batch_size} prompts, each "
                     f"prompt's shared by its n={r.n} samples)")
    if not s.on_gpu:
        notes.append("CPU run: the workers are processes in node RAM; offload moves nothing")
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
             "batch share": batch_bytes(config, s.ranked) // s.world}
    if phase == "update":
        micro, accumulates = update_micro(config, s)
        transient = update_transient(config, s, hf_config, micro, accumulates, states.grads, False)
    else:
        transient = forward_peak(config, s, hf_config, grad=False, micro=experience_micro(config, s, role),
                                 role=role)
    parts.update(transient)
    return parts
