"""The memory plan of an SFT run (``trainer.task=sft``): one role, the actor, in the phases its trainer times.

An SFT run has no rollout engine, reference or reward workers: the actor
works on every one of the ``trainer.nnodes x trainer.workers_per_node``
devices. Per optimizer step it runs, in the names of the SFT trainer's
phase spans (which ``memory.jsonl`` and the watchdog's advice use):

- ``forward_backward``: each micro batch's forward, which keeps activations
  and the loss's logits for backward, then backward; gradients accumulate
  across micro batches;
- ``optimizer``: every gradient plus the optimizer step's temporaries;
- ``validate`` (at validation): the validation loss (a no-grad forward per
  micro batch) and greedy generation of the validation prompts (KV cache).

Before the first step, ``setup`` (the workers' model build) loads the whole
model in fp32 in every worker at once; it is checked like the others but kept
apart from the running peaks (``Plan.once``), which the watchdog compares with.

A micro batch holds ``micro_batch_size_per_device_for_update`` samples of
``data.max_prompt_length + data.max_response_length`` tokens (image tokens
included), or with ``padding_free`` one flattened sequence of
``max_token_len_per_device`` tokens. The loss computes logits only at
trained (assistant) positions; the plan prices every position (the worst
case) and says so in its notes.

The actor's states follow its strategy: FSDP2 (:func:`states.role_states`:
fp32 master shards, fp32 gradients, AdamW moments; ``offload.params`` puts
all three in host RAM) or DeepSpeed ZeRO (:func:`states.zero_states`). Frozen
parts and LoRA shrink the trained count as they do for the RL actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

from easytrain.config.data_spec import split_files
from easytrain.config.schema import Config
from easytrain.memory.activations import MicroShape, model_dims, packed_micro, sft_logits_bytes, shard_units
from easytrain.memory.budget import kv_bytes_per_token
from easytrain.memory.capacity import CUDA_WORKSPACE_BYTES, Capacity, Plan, Row, gpu_process_device, sum_parts
from easytrain.memory.host import (CHECKPOINT_FILE_BYTES, batch_pages, batches_in_flight, heap_keeps_freed,
                                   maps_checkpoint, node_host, pass_activations, received_batch, run_phases,
                                   store_pages, worker_process)
from easytrain.memory.params import (count_parameters, hf_config_object, largest_module, largest_trainable,
                                     trainable_by_component)
from easytrain.memory.states import (DTYPE_BYTES, FP32, ZERO_REDUCE_BUCKET, ZERO_SUB_GROUP, gathered_bytes,
                                     role_states, shard_degree, zero_states)

SFT_PHASES = ("forward_backward", "optimizer", "validate")
"""The SFT trainer's phase spans, in the order they run."""
PLAN_PHASES = ("setup", *SFT_PHASES)
"""The plan's rows: the workers' model build (once, before the first step), then the step's phases."""
TOKEN_TENSORS = 7
"""int64 values per token of an SFT batch: ids, attention mask, targets, token types, three rope positions."""


@dataclass(frozen=True)
class SFTShape:
    """What the SFT plan needs from the config and model, computed once."""

    world: int
    per_node: int
    total_params: int
    trainable: int
    vision_grad: bool
    largest_trainable: int
    largest_module: int
    """Elements of the largest module (what a checkpoint's largest shard is cut from)."""
    sample_tokens: int
    """Tokens of the longest sample: data.max_prompt_length + data.max_response_length."""
    images: int
    """Images per full-length sample."""
    image_tokens: int
    micro: MicroShape
    accumulates: bool
    """Whether a rank runs more than one micro batch per optimizer step (gradients wait between them)."""
    dtype_bytes: int
    on_gpu: bool
    values_per_token: int
    """fp32 ``pixel_values`` values behind one image token (:attr:`ModelDims.values_per_token`)."""


def sample_images(config: Config, hf_config: dict[str, Any]) -> tuple[int, int]:
    """(images, tokens per image) of the longest sample: ``data.limit_images`` at ``data.max_pixels`` (and
    the videos' temporal patches, priced as images: :func:`easytrain.memory.budget.video_patches`), each
    image taking at most its share of the whole sample's budget (a longer sample is refused)."""
    from easytrain.memory.budget import tokens_per_image, video_patches

    d = config.data
    vision = getattr(hf_config_object(hf_config), "vision_config", None) if d.image_key else None
    images = d.limit_images + video_patches(d)
    if vision is None or not images:
        return 0, 0
    per_image = tokens_per_image(hf_config, d.max_pixels)
    return images, min(per_image, (d.max_prompt_length + d.max_response_length) // images)


def sft_shape(config: Config, hf_config: dict[str, Any]) -> SFTShape:
    t, a, d = config.trainer, config.worker.actor, config.data
    world = t.nnodes * t.workers_per_node
    tokens = d.max_prompt_length + d.max_response_length
    images, per_image = sample_images(config, hf_config)
    per_rank = max(1, a.global_batch_size // (world // a.ulysses_size))
    if a.padding_free:  # one flattened sequence, with the image share of full-length samples, of at most the
        budget = min(a.max_token_len_per_device, per_rank * tokens)  # rank's share of the global batch
        micro = packed_micro(budget, tokens, d.max_response_length, images, per_image)
        accumulates = per_rank * tokens > a.max_token_len_per_device
    else:
        size = min(a.micro_batch_size_per_device_for_update, per_rank)
        micro = MicroShape(size, tokens, d.max_response_length, images, per_image)
        accumulates = per_rank > size
    trainable = trainable_by_component(hf_config, config.model)
    return SFTShape(world=world, per_node=t.workers_per_node, total_params=count_parameters(hf_config).total,
                    trainable=sum(trainable.values()), vision_grad=trainable.get("vision_tower", 0) > 0,
                    largest_trainable=largest_trainable(hf_config, config.model),
                    largest_module=largest_module(hf_config), sample_tokens=tokens,
                    images=images, image_tokens=per_image, micro=micro, accumulates=accumulates,
                    dtype_bytes=DTYPE_BYTES[config.model.dtype], on_gpu=t.device == "cuda",
                    values_per_token=model_dims(hf_config).values_per_token)


# ----------------------------------------------------------------------------- the actor's states


@dataclass(frozen=True)
class ActorStates:
    """One rank's model states by where they live and when."""

    kept: dict[str, int]
    """On the device between steps."""
    grads: dict[str, int]
    """On the device from the first backward to the step."""
    host: dict[str, int]
    """In the worker's host RAM between steps."""
    host_grads: dict[str, int] = field(default_factory=dict)
    """In host RAM from the first backward to the step."""
    step: dict[str, int] = field(default_factory=dict)
    """The optimizer step's temporaries on the device."""
    step_host: dict[str, int] = field(default_factory=dict)
    """The optimizer step's temporaries in host RAM (an offloaded optimizer steps there)."""
    sharded: bool = True
    """Parameters are gathered unit by unit for each pass (FSDP, ZeRO-3)."""
    reshard: bool = True
    bucket: int = 0
    """A gradient reduce bucket alive during backward (DeepSpeed)."""


def actor_states(config: Config, s: SFTShape) -> ActorStates:
    """The actor's states under its strategy (``worker.actor.strategy``)."""
    return _zero_actor(config, s) if config.worker.actor.strategy == "deepspeed" else _fsdp_actor(config, s)


def _fsdp_actor(config: Config, s: SFTShape) -> ActorStates:
    a = config.worker.actor
    degree = shard_degree(a.fsdp.shard_size, s.world)
    st = role_states(s.total_params, s.trainable, degree, trains=True, offload_params=a.offload.params)
    states = {"actor params": st.params, "actor optimizer": st.optimizer}
    grads = {"actor grads": st.grads}
    step = {"optimizer temporaries": 2 * -(-s.largest_trainable // degree) * FP32}
    sharded = not (degree == 1 and s.dtype_bytes == FP32)  # FSDP is applied (see workers.base)
    if st.offloaded:  # CPU offload keeps parameters, gradients and optimizer states in host RAM; it steps there
        return ActorStates(kept={}, grads={}, host=states, host_grads=grads, step_host=step, sharded=sharded,
                           reshard=a.fsdp.full_shard)
    return ActorStates(kept=states, grads=grads, host={}, step=step, sharded=sharded, reshard=a.fsdp.full_shard)


def _zero_actor(config: Config, s: SFTShape) -> ActorStates:
    ds = config.worker.actor.deepspeed
    z = zero_states(s.total_params, s.trainable, s.world, s.dtype_bytes, ds.zero_stage, ds.offload_params,
                    ds.offload_optimizer)
    params = {"actor params": z.params}
    optimizer = {"actor optimizer (fp32 master + moments)": z.master + z.moments}
    steps = {k: v for k, v in {"fp32 gradient partition": z.step_grads,
                               "optimizer temporaries": z.step_temporaries}.items() if v}
    return ActorStates(kept={**({} if z.params_on_host else params), **({} if z.optimizer_on_host else optimizer)},
                       grads={"actor grads": z.grads} if z.grads else {},
                       host={**(params if z.params_on_host else {}), **(optimizer if z.optimizer_on_host else {})},
                       host_grads={"actor fp32 gradients": z.host_grads} if z.host_grads else {},
                       step={} if z.optimizer_on_host else steps, step_host=steps if z.optimizer_on_host else {},
                       sharded=ds.zero_stage >= 3, bucket=min(ZERO_REDUCE_BUCKET, s.trainable) * s.dtype_bytes)


# ----------------------------------------------------------------------------- the phases


def _gathered(config: Config, st: ActorStates, s: SFTShape, hf_config: dict[str, Any], grad: bool) -> int:
    if not st.sharded:
        return 0
    root, block = shard_units(hf_config)
    return gathered_bytes(s.total_params, root, block, s.dtype_bytes, grad=grad, reshard=st.reshard,
                          kept=heap_keeps_freed(config, s.on_gpu))


def pass_bytes(config: Config, s: SFTShape, st: ActorStates, hf_config: dict[str, Any], grad: bool) -> dict[str, int]:
    """Transient bytes of one micro batch's forward (with ``grad``: what backward finds at its start)."""
    dims = model_dims(hf_config)
    u = config.worker.actor.ulysses_size
    positions = -(-s.micro.sequences * s.micro.tokens // u)
    parts = {**pass_activations(config, "activations", dims, s.micro, s.dtype_bytes, s.on_gpu, grad=grad,
                                checkpointing=config.model.gradient_checkpointing, vision_grad=s.vision_grad,
                                eager=config.model.attn_implementation == "eager", ulysses=u),
             "logits": sft_logits_bytes(positions, dims.vocab, grad=grad),
             "gathered": _gathered(config, st, s, hf_config, grad)}
    if grad and st.bucket:
        parts["reduce bucket"] = st.bucket
    return parts


def validation_prompts(config: Config, otherwise: int) -> int:
    """Prompts one validation generation call takes (all ranks together): ``data.val_batch_size``, or the
    whole validation set, and never more than the set's rows (counted when its files are on this machine:
    :func:`validation_rows`; ``otherwise`` for a hub dataset, whose length is unknown before it downloads)."""
    d = config.data
    rows = validation_rows(tuple(split_files(d.val_files)), d.synthetic_val_size)
    if d.val_batch_size > 0:
        return d.val_batch_size if rows is None else max(1, min(d.val_batch_size, rows))
    return otherwise if rows is None else max(1, rows)


@lru_cache(maxsize=8)
def validation_rows(specs: tuple[str, ...], synthetic_size: int) -> Optional[int]:
    """Rows of the validation data (read once per process: a jsonl file is scanned for its lines)."""
    from easytrain.data.sources import local_rows

    return local_rows(specs, synthetic_size)


def generation_bytes(config: Config, s: SFTShape, st: ActorStates, hf_config: dict[str, Any]) -> dict[str, int]:
    """Greedy generation of a rank's share of the validation prompts at once: prefill of the longest prompt,
    the KV cache of prompt and response, the last position's logits (and their fp32 copy). FSDP holds every
    unit unsharded for the whole ``generate`` (``distributed.fsdp.gathered``); ZeRO-3 gathers module by module."""
    rows = -(-validation_prompts(config, config.worker.actor.global_batch_size) // s.world)
    dims = model_dims(hf_config)
    response = config.data.max_response_length
    prompt = MicroShape(rows, s.sample_tokens, 0, s.images, s.image_tokens)
    fsdp = config.worker.actor.strategy == "fsdp"
    gathered = s.total_params * s.dtype_bytes if fsdp and st.sharded else _gathered(config, st, s, hf_config, False)
    return {"kv cache": rows * (s.sample_tokens + response) * kv_bytes_per_token(hf_config, config.model.dtype),
            **pass_activations(config, "prefill", dims, prompt, s.dtype_bytes, s.on_gpu, grad=False,
                               checkpointing=False, vision_grad=False),
            "logits": rows * dims.vocab * (s.dtype_bytes + FP32), "gathered": gathered}


def phase_device(config: Config, s: SFTShape, st: ActorStates, hf_config: dict[str, Any],
                 phase: str) -> dict[str, int]:
    """What one device (on CPU: one worker process) holds at the peak of ``phase``, states included."""
    if phase == "setup":
        return setup_device(config, s, st)
    if phase == "forward_backward":
        parts = {**st.kept, **pass_bytes(config, s, st, hf_config, grad=True)}
        if s.accumulates:  # the previous micro batches' gradients wait for this one's
            parts.update(st.grads)
        if heap_keeps_freed(config, s.on_gpu):  # one call with the step: the passes' freed blocks stay resident
            parts.update({**st.grads, **st.step})
            if s.accumulates and st.sharded:  # FSDP: each micro batch's sum replaces the last one, which the heap keeps
                parts.update({f"{k} (freed, kept by the heap)": v for k, v in st.grads.items()})
        return parts
    if phase == "optimizer":
        return {**st.kept, **st.grads, **st.step}
    loss = pass_bytes(config, s, st, hf_config, grad=False)
    generation = generation_bytes(config, s, st, hf_config)
    return {**st.kept, **(loss if sum_parts(loss) >= sum_parts(generation) else generation)}


def setup_device(config: Config, s: SFTShape, st: ActorStates) -> dict[str, int]:
    """The model build (``workers.base.build_sharded_model``) on its busiest device. FSDP over several ranks:
    rank 0 reads the whole fp32 model on the CPU, the others build on the meta device, and each keeps its shard
    (:mod:`easytrain.distributed.load`); ZeRO-3 over several ranks builds each rank's partition as the model is
    constructed (``deepspeed.zero.Init``), gathering one module at a time to load its weights; DeepSpeed ZeRO-1/2,
    or one rank, loads the whole model in every worker and takes it whole onto the device."""
    whole = {"whole fp32 model (loading)": s.total_params * FP32}
    if zero3_partitions_at_build(config, s):  # zero.Init: each rank its fp32 partition, one module gathered to load
        return {"actor params (fp32 partition, loading)": -(-s.total_params // s.world) * FP32,
                "gathered module (loading)": s.largest_module * FP32}
    if config.worker.actor.strategy == "deepspeed":
        return whole
    if not s.on_gpu:
        if maps_checkpoint(config, s.on_gpu, s.world, s.dtype_bytes, config.worker.actor.offload.params):
            return {}  # the checkpoint file's pages, mapped: resident once the first pass reads them
        return {**whole, **(_shard(st) if rank0_loads(config, s) else {})}
    params = {k: v for k, v in st.kept.items() if k == "actor params"}
    if s.world > 1:
        return params
    # one rank's build also holds a transient fp32 copy of the largest module and runs its first kernels (the
    # math libraries' workspaces): 0.68 GB above the parameters for the ~0.6B model's SFT set-up on an H200
    # (bench/results/gpu_smoke.json, run half_b_sft_bf16, phase load: a calibration row); measured, not traced to
    # the line that holds it
    return {**params, "largest module (fp32, transient)": s.largest_module * FP32,
            "cuda library workspaces": CUDA_WORKSPACE_BYTES}


def batch_bytes(config: Config, s: SFTShape) -> int:
    """An optimizer step's global batch as the driver holds it: per token the int64 tensors, per sample the
    fp32 pixel values of its images."""
    pixels = s.images * s.image_tokens * s.values_per_token * FP32
    return config.worker.actor.global_batch_size * (s.sample_tokens * 8 * TOKEN_TENSORS + pixels)


def val_batch_bytes(config: Config, s: SFTShape) -> int:
    """A validation's batches as the driver holds them: the validation rows for the loss, and again as the
    prompts it generates from (both with their pixels)."""
    rows = validation_prompts(config, config.worker.actor.global_batch_size)
    return 2 * rows * (s.sample_tokens * 8 * TOKEN_TENSORS + s.images * s.image_tokens * s.values_per_token * FP32)


def call_batch(config: Config, s: SFTShape, phase: str) -> int:
    """The batch a call of ``phase`` receives (bytes, all ranks together) beyond the one micro batch's pixels its
    pass prices as input: the update (``sft_update``: its forward-backward and optimizer phases) the step's
    micro batches. A validation's two calls are not added: the plan prices its generate, whose prefill holds
    every prompt's pixels at once, above its loss pass."""
    micro = s.micro.sequences * s.micro.images * s.micro.image_tokens * s.values_per_token * FP32
    call = batch_bytes(config, s)
    return max(0, call - micro * s.world) if phase in ("forward_backward", "optimizer") else 0


def paged_batches(config: Config, s: SFTShape, phase: str) -> int:
    """The object store's pages the run's batches went through by ``phase`` (what each process keeps mapped:
    :func:`easytrain.memory.host.batches_in_flight`): a step's batch, and once a validation has run one
    validation batch beside it, the generation prompts reusing the loss batch's pages (measured: a worker's
    RssShmem after validating 64 rows of one 448 px image was 0.386 GB, one 0.31 GB batch and a 0.077 GB step;
    16 rows of two, 0.232 GB, one 0.155 GB batch and a step)."""
    return store_pages(config, phase, [batch_bytes(config, s)], val_batch_bytes(config, s) // 2)


def phase_offloaded(st: ActorStates, phase: str) -> dict[str, int]:
    """What one worker keeps in host RAM in ``phase``: offloaded states, gradients until the step, the
    step's temporaries when the optimizer steps there."""
    return {**st.host, **(st.host_grads if phase != "validate" else {}),
            **(st.step_host if phase == "optimizer" else {})}


def _host(config: Config, s: SFTShape, st: ActorStates, phase: str,
          device: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(node, one worker process) host bytes in ``phase`` (:mod:`easytrain.memory.host`). The model build
    (``setup``, the ``load`` phase) on a GPU node holds the whole fp32 model in host RAM in each worker that
    reads it: rank 0 when FSDP shards over several ranks (:mod:`easytrain.distributed.load`), every worker
    otherwise (DeepSpeed, one rank)."""
    n = s.per_node
    extra: dict[str, int] = {}
    if phase == "setup":
        whole = s.total_params * FP32
        held = ({"model loading (whole, fp32)": whole} if s.on_gpu else dict(device))
        if zero3_partitions_at_build(config, s):  # every worker reads the checkpoint a file at a time
            held = {"checkpoint file (loading)": min(whole, CHECKPOINT_FILE_BYTES), **({} if s.on_gpu else device)}
        process = worker_process("load", held, s.on_gpu)
        readers = 1 if rank0_loads(config, s) else n
        others = worker_process("load", _shard(st) if not s.on_gpu else {}, s.on_gpu)
        return node_host(config, "load", [(readers, process), (n - readers, others)], False), process
    held = phase_offloaded(st, phase) if s.on_gpu else {**device, **phase_offloaded(st, phase)}
    largest = paged_batches(config, s, phase)
    process = worker_process(phase, {**held, **batch_pages(largest, s.world),
                                     **received_batch(call_batch(config, s, phase), s.world)}, s.on_gpu)
    # validating, the driver also holds the loss batches' micro batches it cut (copies: padding-free micro batches
    # regroup samples by length)
    held = val_batch_bytes(config, s) * 3 // 2 if phase == "validate" else batch_bytes(config, s)
    extra.update(batches_in_flight(held, largest))
    return node_host(config, phase, [(n, process)], False, extra), process


def zero3_partitions_at_build(config: Config, s: SFTShape) -> bool:
    """Whether the actor is built partitioned (ZeRO-3 over several ranks: ``distributed.deepspeed.zero3_construction``)."""
    a = config.worker.actor
    return a.strategy == "deepspeed" and a.deepspeed.zero_stage == 3 and s.world > 1


def rank0_loads(config: Config, s: SFTShape) -> bool:
    """Whether only rank 0 reads the checkpoint (FSDP over several ranks), the others building on meta."""
    return config.worker.actor.strategy == "fsdp" and s.world > 1


def _shard(st: ActorStates) -> dict[str, int]:
    return {k: v for k, v in {**st.kept, **st.host}.items() if "params" in k}


def plan_sft(config: Config, hf_config: dict[str, Any], capacity: Capacity) -> Plan:
    """The SFT run's plan: a row per phase of the actor, then its checkpoint save, resume and export."""
    s = sft_shape(config, hf_config)
    st = actor_states(config, s)
    rows = []
    for phase in PLAN_PHASES:
        parts = phase_device(config, s, st, hf_config, phase)
        if s.on_gpu:
            parts.update(gpu_process_device(phase))
        host, process = _host(config, s, st, phase, parts)
        rows.append(Row(phase, "actor", sum_parts(parts), sum_parts(host), parts, host, sum_parts(process)))
    once = [r for r in rows if r.phase == "setup"]
    kept = {**st.kept, **st.host} if not s.on_gpu else dict(st.host)
    state = sum(v for k, v in {**st.kept, **st.host}.items() if "params" in k or "optimizer" in k)
    trainable = -(-s.trainable // s.world) * FP32  # the trainable shards in fp32 (FSDP full shard, ZeRO)
    largest = paged_batches(config, s, "checkpoint_save")
    once += run_phases(config, kept=kept, resumed=kept, state=state, trainable=trainable,
                       largest_tensor=s.largest_trainable,
                       largest_shard=-(-s.largest_module // s.world) * FP32,
                       total_params=s.total_params, per_node=s.per_node, processes_per_node=s.per_node,
                       node_ram=capacity.node_ram, on_gpu=s.on_gpu, rl=False, driver_pages=largest,
                       saver_pages=sum(batch_pages(largest, s.world).values()),
                       device={**st.kept, **gpu_process_device("checkpoint_save")} if s.on_gpu else dict(st.kept))
    return Plan([r for r in rows if r not in once], capacity, s.on_gpu, _notes(config, s), once=once)


def _notes(config: Config, s: SFTShape) -> list[str]:
    a, m = config.worker.actor, s.micro
    per_rank = max(1, a.global_batch_size // (s.world // a.ulysses_size))
    images = f", {m.images} image(s) of {m.image_tokens} tokens" if m.images else ""
    if a.padding_free:
        shape = f"one padding-free sequence of {m.tokens} tokens (max_token_len_per_device{images})"
        steps = f"the {per_rank} samples of a rank per optimizer step packed into as many as they need"
    else:
        shape = f"{m.sequences} sample(s) x {m.tokens} tokens (max_prompt_length + max_response_length{images} each)"
        steps = f"{-(-per_rank // m.sequences)} micro batch(es) per rank per optimizer step"
    notes = [f"SFT micro batch: {shape}; {steps}",
             "SFT logits: priced at every position of the micro batch (the loss computes them only at trained, "
             "assistant tokens: the worst case)"]
    if a.strategy == "fsdp" and a.offload.optimizer and not a.offload.params:
        notes.append("worker.actor.offload.optimizer has no effect under FSDP2 without offload.params (optimizer "
                     "states live where the parameter shards do); DeepSpeed offloads the optimizer alone: "
                     "worker.actor.strategy=deepspeed worker.actor.deepspeed.offload_optimizer=true")
    if a.strategy == "deepspeed":
        notes.append(f"DeepSpeed ZeRO-{a.deepspeed.zero_stage}: assumes its default reduce bucket "
                     f"({ZERO_REDUCE_BUCKET:.0e} elements) and sub-group ({ZERO_SUB_GROUP:.0e} elements), and "
                     "torch AdamW stepping each flat partition")
    d = config.data
    if d.val_files is not None and d.val_batch_size < 0 and not str(d.val_files).startswith("synthetic:"):
        notes.append(f"validation: data.val_batch_size=-1 generates for the whole validation set at once; priced "
                     f"as {validation_prompts(config, config.worker.actor.global_batch_size)} prompts "
                     "(worker.actor.global_batch_size)")
    if not s.on_gpu:
        notes.append("CPU run: the actor's workers are processes in node RAM; offload moves nothing")
    return notes


def sft_worker_parts(config: Config, phase: str, hf_config: dict[str, Any]) -> dict[str, int]:
    """Bytes of one actor worker process in ``phase`` on CPU above an empty worker process, by part: its
    device parts plus its share of the step batch (``update`` means ``forward_backward``)."""
    s = sft_shape(config, hf_config)
    st = actor_states(config, s)
    phase = "forward_backward" if phase == "update" else phase
    if phase not in PLAN_PHASES:
        raise ValueError(f"an SFT actor has no phase {phase!r}; its phases are {', '.join(PLAN_PHASES)}")
    if phase == "setup":
        return phase_device(config, s, st, hf_config, phase)
    return {**phase_device(config, s, st, hf_config, phase), **phase_offloaded(st, phase),
            "batch share": batch_bytes(config, s) // s.world}
