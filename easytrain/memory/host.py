"""Host RAM of a run, process by process: what the plan's host figures add up.

A node's host bytes in a phase are the resident sets (RSS) of its processes summed: every worker process
(:func:`worker_process`: the framework it imports, the phase's working set, and the tensors it keeps in host
RAM; on CPU every tensor), the driver and Ray's own processes on the head node, the watchdog's sampler, the
reward and data-loader processes (:func:`other_processes`). That is how ``bench/planner_accuracy.py``
measures a run, and how Ray's memory monitor chooses a process to kill. Shared library pages count once in
every process that maps them, so the sum is above the node's used memory: on the safe side.

Besides the step's phases a run has phases of its own (:func:`run_phases`), each checked like a step phase:

- ``checkpoint_save``: every worker holds its step-boundary states plus what the save stages in host RAM
  (:func:`save_staging`: at most ``trainer.checkpoint_host_buffer_gb`` per process, or with
  ``trainer.checkpoint_async`` a whole copy of the process's state);
- ``resume_load``: every worker holds its states (the optimizer's moments exist from the load on) plus the
  read buffer of the largest tensor;
- ``export``: one process (``easytrain export``) loads the whole model in fp32 and writes it (safetensors
  writes from the tensors' memory: the ~180M bench model's export peaked at the process plus its fp32 weights).

The constants are resident sets measured on CPU on this machine (torch 2.13, transformers 5.x, ray 2.60, glibc
malloc) by ``bench/planner_accuracy.py``'s calibration cases (``bench/results/planner_accuracy.json``, the rows
tagged ``calibration``, re-measured at 3ab11d5); its held-out rows, a drawn seed, check them. On a GPU node
the tensors live on the device and are priced there; a worker's host figure is its framework with the CUDA
libraries, the phase's working set (both measured on one H200: ``bench/gpu_smoke.py``) and what is offloaded;
while loading, the process that reads the checkpoint holds it in host RAM.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

from easytrain.config.presets import RANDOM_PREFIX
from easytrain.config.schema import Config
from easytrain.memory.activations import MicroShape, ModelDims, activation_bytes
from easytrain.memory.capacity import GB, Row, sum_parts
from easytrain.memory.states import FP32

WORKER_BYTES = int(0.54 * GB)
"""A worker process after its set-up, before any tensor of note: python, torch, transformers, peft, Ray's core
worker and the roles' code (0.54 GB measured: a fused worker of the tiny model after setup)."""
PHASE_WORKING_SET = {"load": 0, "generation": int(0.06 * GB), "validation": int(0.085 * GB),
                     "ref_log_probs": int(0.08 * GB), "old_log_probs": int(0.08 * GB), "update": int(0.085 * GB),
                     "weight_sync": int(0.08 * GB), "checkpoint_save": int(0.075 * GB),
                     "resume_load": int(0.02 * GB), "forward_backward": int(0.045 * GB), "optimizer": int(0.045 * GB),
                     "validate": int(0.075 * GB)}
"""CPU: what a phase's code path adds to a worker's RSS beyond the tensors the plan prices (kernel scratch,
the autograd engine and its threads, malloc arenas that keep freed blocks): the largest reading of the tiny
model's calibration runs (tiny_rl_fused, tiny_rl_1worker, tiny_sft; one and two workers), where tensors are
negligible."""
DRIVER_START_BYTES = int(0.62 * GB)
"""The driver while the workers load or resume (0.60 to 0.62 GB measured in the calibration runs)."""
DRIVER_BYTES = int(0.66 * GB)
"""The driver during the steps besides the batches it holds (:func:`batches_in_flight`): data, rewards, metrics
and loggers (median 0.65 GB over the calibration runs' step phases, 0.60 to 0.97)."""
RAY_HEAD_BYTES = int(0.50 * GB)
"""Ray's own processes on the head node without the dashboard: GCS, raylet (the object store's touched pages
are counted with the batch), log monitor, monitor, dashboard and runtime-env agents, multiprocessing helpers
(with the dashboard 1.58 to 1.60 GB measured in every calibration run's phases)."""
RAY_DASHBOARD_BYTES = int(1.10 * GB)
"""The dashboard and its module processes (``ray.include_dashboard=true``, the default; 1.08 GB measured)."""
SAMPLER_BYTES = int(0.14 * GB)
"""The watchdog's sampler actor, one per node (0.13 GB measured)."""
REWARD_WORKER_BYTES = int(0.14 * GB)
"""A reward worker (0.13 GB measured)."""
LOADER_WORKER_BYTES = int(0.48 * GB)
"""A data-loader worker process (torch and the data code imported; assumed as an empty worker, unmeasured)."""
EXPORT_PROCESS_BYTES = int(0.59 * GB)
"""``easytrain export`` besides the fp32 model, writing the whole model (0.586 GB measured with the tiny model)."""
EXPORT_ADAPTER_PROCESS_BYTES = int(0.50 * GB)
"""The same writing a LoRA adapter alone, besides the fp32 base model it holds like a full export: measured (the
export's own VmHWM, calibration rows re-measured at e2f0793) 0.46 GB with the tiny model, 0.46 with the small one
and 0.53 with the ~184M one, each less its fp32 weights. Earlier readings of 0.45-0.50 GB for the whole process,
which had the base model's weights never touched, were wait4's ru_maxrss while the bench reset the export's
high-water mark every 0.02 s: the last interval's peak, not the process's."""
STARTING = ("load", "resume_load")


GPU_WORKER_BYTES = int(2.31 * GB)
"""A GPU worker process between phases: the CPU worker's share plus the CUDA runtime and libraries it maps
(cuBLAS, cuDNN, NCCL; 2.31 to 2.33 GB measured in the weight sync of a fused worker of the tiny and the ~0.6B
model on an H200, torch 2.11 with CUDA 13: bench/gpu_smoke.py's runs tiny_bf16 and half_b_bf16, phase
weight_sync, calibration rows; their host readings were in the runs' memory.jsonl, which the results file
bench/results/gpu_smoke.json does not keep: it records their device figures only)."""
GPU_LOAD_BYTES = int(1.05 * GB)
"""The same process while it loads, before its first kernel has loaded the CUDA libraries (1.05 GB measured with
the tiny model: bench/gpu_smoke.py's run tiny_bf16, phase load; a calibration row, not kept in its results
file)."""
GPU_PHASE_WORKING_SET = {"generation": int(0.10 * GB), "validation": int(0.07 * GB), "update": int(0.26 * GB),
                         "ref_log_probs": int(0.10 * GB), "old_log_probs": int(0.10 * GB),
                         "forward_backward": int(0.26 * GB), "optimizer": int(0.26 * GB), "validate": int(0.07 * GB),
                         "checkpoint_save": int(0.02 * GB)}
"""GPU: what a phase adds to the worker's host RSS (measured in the same runs, bench/gpu_smoke.py's tiny_bf16
and half_b_bf16, calibration rows not kept in its results file: generation 0.09-0.10 GB, validation
0.04-0.07, update 0.24-0.26; the log-prob and SFT phases were not run there and take generation's and
update's figures)."""


def worker_process(phase: str, held: dict[str, int], on_gpu: bool) -> dict[str, int]:
    """One worker process's host bytes in ``phase``: the framework (on GPU with the CUDA libraries), the phase's
    working set, and ``held`` (the tensors it keeps in host RAM: on CPU all of them)."""
    if on_gpu:
        parts = {"worker processes (framework)": GPU_LOAD_BYTES if phase == "load" else
                 GPU_WORKER_BYTES}
        if GPU_PHASE_WORKING_SET.get(phase):
            parts[f"{phase} working set"] = GPU_PHASE_WORKING_SET[phase]
    else:
        parts = {"worker processes (framework)": WORKER_BYTES}
        if PHASE_WORKING_SET.get(phase):
            parts[f"{phase} working set"] = PHASE_WORKING_SET[phase]
    parts.update({k: v for k, v in held.items() if v})
    return parts


def other_processes(config: Config, phase: str, rl: bool) -> dict[str, int]:
    """The head node's processes besides the workers, in ``phase``."""
    parts = {"driver": DRIVER_START_BYTES if phase in STARTING else DRIVER_BYTES,
             "ray (gcs, raylet, agents)": RAY_HEAD_BYTES}
    if config.ray.include_dashboard:
        parts["ray dashboard"] = RAY_DASHBOARD_BYTES
    if config.watchdog.enabled:
        parts["memory sampler"] = SAMPLER_BYTES
    if rl and config.reward.num_workers and phase != "load":  # the reward pool starts after the workers load
        parts["reward workers"] = REWARD_WORKER_BYTES * config.reward.num_workers
    if config.data.num_workers:
        parts["data loader workers"] = LOADER_WORKER_BYTES * config.data.num_workers
    return parts


def batches_in_flight(held: int, paged: int) -> dict[str, int]:
    """The driver's part of the batches a phase sends through Ray's object store: ``held``, the batch the driver
    builds or receives in this phase, and ``paged``, the object store's pages the driver has written and read by
    then (:func:`store_pages`: a process keeps the pages it touched mapped, so they stay in its RSS). Each worker
    process keeps its share of those pages the same way (:func:`batch_pages`)."""
    return {"batch (driver)": held, "object store pages (driver)": paged}


def validated_by(config: Config, phase: str) -> bool:
    """Whether a validation has run by the time ``phase`` runs: validation itself and a checkpoint save (the last
    one follows the end-of-run validation); a step phase when the run validates before or between steps."""
    t = config.trainer
    if not config.data.val_files:
        return False
    return phase in ("validation", "validate", "checkpoint_save") or t.val_before_train or t.val_freq > 0


def store_pages(config: Config, phase: str, calls: Sequence[int], validation: int) -> int:
    """The object store's pages the run's batches have gone through by ``phase``, among the processes that
    received them: every call of a step (``calls``: the bytes each sends, all ranks together) its own pages, and
    once a validation has run (:func:`validated_by`) its ``validation`` batch's beside them. Measured on CPU
    (RssShmem of each worker per call, memory.jsonl's phase_peak records; small_rl_448x3 and held-out s8_03 at
    bf42889, three 448 px images per prompt over two fused workers): each call of the first step added the rank's
    share of that call's batch (generate, old log-probs, update: 0.058 GB each for s8_03), the next steps added
    nothing (the store places them again where the last step's were), a validation its share of its batch once."""
    return sum(calls) + (validation if validated_by(config, phase) else 0)


def batch_pages(paged: int, processes: int) -> dict[str, int]:
    """One worker process's share of the object store's pages its calls' batches went through (``paged``, from
    :func:`store_pages`; its slice of each, among ``processes`` receivers)."""
    return {"object store pages (batches)": -(-paged // max(1, processes))}


def received_batch(call_bytes: int, processes: int) -> dict[str, int]:
    """What a worker process holds of the batch its call received, while the call runs: its share of the call's
    batch (``call_bytes``, all ``processes`` receivers together), deserialized into its private memory. Ray copies
    a task's arguments out of the object store (the pages it read stay mapped besides: :func:`batch_pages`); probed
    on this machine (an actor taking a 0.2 GB tensor argument: RssAnon +0.20 GB for the call, RssShmem +0.20 GB
    kept), and read in an SFT worker's update over 448 px images (bench/planner_repeatability.py's
    sft_448x3_1worker: RssAnon 0.30 GB above its set-up at the update's end, 0.23 of them its batch)."""
    return {"batch (received, deserialized)": -(-call_bytes // max(1, processes))} if call_bytes else {}


def node_host(config: Config, phase: str, workers: list[tuple[int, dict[str, int]]], rl: bool,
              extra: Optional[dict[str, int]] = None) -> dict[str, int]:
    """A node's host bytes by what holds them: ``workers`` (how many processes hold each
    :func:`worker_process` breakdown; alike parts add up), the other processes and ``extra`` (batches,
    transport buffers)."""
    parts: dict[str, int] = {}
    for count, process in workers:
        for key, value in process.items():
            if count and value:
                parts[key] = parts.get(key, 0) + count * value
    return {**parts, **other_processes(config, phase, rl), **{k: v for k, v in (extra or {}).items() if v}}


CHECKPOINT_FILE_BYTES = 5 * 10**9
"""The most one file of a Hugging Face checkpoint holds (``save_pretrained``'s default ``max_shard_size``, 5 GB): what a
worker reading the checkpoint a file at a time holds of it (ZeRO-3 construction)."""


def maps_checkpoint(config: Config, on_gpu: bool, world: int, dtype_bytes: int, offloaded: bool) -> bool:
    """Whether a CPU role's parameters are the checkpoint file's mapped pages after the load, resident only once a
    pass first reads them: one process reads the file itself from a folder (a ``random:`` model is built in memory)
    and FSDP is not applied (no shards to copy out: fp32, not offloaded;
    :func:`easytrain.workers.base.build_sharded_model`, the actor's for RL and SFT alike)."""
    return (not on_gpu and not config.model.path.startswith(RANDOM_PREFIX) and world == 1
            and dtype_bytes == FP32 and not offloaded)


def malloc_threshold_bytes(config: Config) -> int:
    """The mmap threshold worker processes fix (``trainer.malloc_mmap_threshold_kb``); 0 = glibc's dynamic one
    (the default), which keeps a call's freed blocks of up to 32 MiB in its heap (what the plan then prices)."""
    return (config.trainer.malloc_mmap_threshold_kb or 0) * 1024


def heap_keeps_freed(config: Config, on_gpu: bool) -> bool:
    """Whether a CPU worker's call keeps the blocks it freed resident until it ends: glibc's dynamic mmap
    threshold rises to the largest block freed (up to 32 MiB), so the per-parameter tensors a call frees (FSDP's
    gathered units and reduced gradients, a weight sync's buckets) go back to its heap, not to the OS, and the
    worker trims the heap only when the call returns. Measured on the ~184M bench model over 2 fused ranks
    (bench/results/planner_accuracy.json, calibration rows mid_rl_fused, mid_sft, mid_rl_lora): every sharded
    pass held the whole gathered model, an update that accumulates over micro batches one more copy of the
    gradient shards, a LoRA weight sync every merged bucket."""
    return not on_gpu and malloc_threshold_bytes(config) == 0


VISION_HEAP_KEPT = {True: 0.5, False: 1.0}
"""In a pass with gradients and without. Fitted on the calibration runs (bench/results/planner_accuracy.json).
Without gradients: the image-heavy small_rl_448x3, small_sft_448x3 and small_rl_448 chose 1.0 (0.6 left their
passes 5-7% low, 1.5 put mid_sft 11% high). With gradients, 0.5, since the ~184M model's image runs mid_rl_448
and mid_rl_448_unshared joined them (added after held-out seed 8's s8_04 update was 25% high per node): at 1.0
their updates were 12-14% high per process, at 0.25 small_rl_448x3's update 6% low and small_sft_448x3's 7%; 0.5
leaves the four within -4% to +6%. Probed
apart on the ~184M bench model, one rank, 448 px against 56 px images (bench/_memory_probe.py, update): the
images added 1.6 times their planned bytes with prompt sharing and 0.7 times without, which this does not
explain; the vision tower alone without gradients, in a fresh process, about 3 times."""


LORA_HEAP_KEPT = {True: 1.5, False: 0.25}
"""Output-sized tensors per LoRA-adapted linear and token that a CPU heap keeps (under glibc's dynamic
threshold), in a pass with gradients and without: the adapter branch's output and its scaled copy, freed as soon
as they are added to the base layer's output (and in backward their gradients). Probed on the ~184M bench model,
LoRA rank 16 on every linear, one rank, padding-free updates of 928 to 3712 tokens (bench/_memory_probe.py,
glibc's dynamic threshold against a fixed 128 KiB one, which returns such blocks at once): 1.3 to 1.7 output sets
per token and layer kept, the fixed threshold's peaks within 6% of the plan without them. Without gradients the
next layer reuses most of the freed blocks: a quarter of a set, read from held-out seed 4's LoRA log-prob passes
(s4_00, s4_09; the probed shapes came from its s4_02 too, so the next held-out quote is a fresh seed)."""
LORA_OUTPUTS = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "o_proj": "hidden", "gate_proj": "intermediate",
                "up_proj": "intermediate", "down_proj": "hidden"}
"""A decoder layer's linear layers by name suffix, with the width of their output."""


def lora_outputs(config: Config, d: ModelDims) -> int:
    """Output elements per token of one decoder layer's LoRA-adapted linear layers (``model.lora``: ``all-linear``
    or the named suffixes; a suffix that is not one of the decoder's linear layers counts as ``hidden`` wide)."""
    targets = config.model.lora.target_modules
    names = LORA_OUTPUTS if "all-linear" in targets else targets
    return sum(getattr(d, LORA_OUTPUTS.get(name, "hidden")) for name in names)


def pass_activations(config: Config, name: str, d: ModelDims, mb: MicroShape, dtype_bytes: int, on_gpu: bool,
                     adapters: bool = True, **how: Any) -> dict[str, int]:
    """A pass's activations (:func:`easytrain.memory.activations.activation_bytes` with ``how``) under ``name``;
    on a CPU worker under glibc's dynamic threshold (:func:`heap_keeps_freed`) also what its heap keeps of the
    temporaries the pass frees, blocks the heap keeps until the call returns: of the vision tower's (the
    attention runs one window or image at a time, each chunk's copies of q, k and v and its output allocated and
    freed beside what a block saves) VISION_HEAP_KEPT of what the micro batch's images add to the pass; of the
    LoRA branches' LORA_HEAP_KEPT output sets per token and layer where the pass runs them (``adapters``: not the
    reference, the actor with its adapters off, nor the rollout engine, whose weights are merged)."""
    total = activation_bytes(d, mb, dtype_bytes, **how)
    parts = {name: total}
    if not heap_keeps_freed(config, on_gpu):
        return parts
    if mb.images:
        vision = total - activation_bytes(d, replace(mb, images=0), dtype_bytes, **how)
        parts["vision temporaries (freed, kept by the heap)"] = int(VISION_HEAP_KEPT[bool(how.get("grad"))] * vision)
    if adapters and config.model.lora.rank > 0:
        tokens = mb.sequences * mb.tokens // how.get("ulysses", 1)
        kept = LORA_HEAP_KEPT[bool(how.get("grad"))] * tokens * d.layers * lora_outputs(config, d) * dtype_bytes
        parts["LoRA temporaries (freed, kept by the heap)"] = int(kept)
    return parts


NODE_FRACTION = 1 / 64
"""trainer.checkpoint_host_buffer_gb=-1: this fraction of the node's RAM, shared by its worker processes ..."""
BUFFER_RANGE = (2**28, 2**31)
"""... clamped to 0.25-2 GiB per process: enough for fast sequential writes, little beside a step's memory."""
MIN_PIECE = 2**20
"""The smallest piece a save cuts a tensor into, whatever the buffer: below it the fsyncs cost more than the
memory they save (:mod:`easytrain.distributed.checkpoint` cuts at half the buffer, at least this)."""


def host_buffer_bytes(buffer_gb: float, node_ram_bytes: int, processes_per_node: int) -> int:
    """``trainer.checkpoint_host_buffer_gb`` in bytes; -1 = NODE_FRACTION of the node's RAM divided by the worker
    processes on it, clamped to BUFFER_RANGE (e.g. 8 processes on a 2 TB node get 2 GiB, on a 1 TB one 1.8 GiB,
    on a 256 GB one 0.47 GiB). The rule the saving workers size their buffer by, and the plan prices."""
    if buffer_gb > 0:
        return int(buffer_gb * 2**30)
    share = NODE_FRACTION * node_ram_bytes / max(1, processes_per_node)
    return int(min(max(share, BUFFER_RANGE[0]), BUFFER_RANGE[1]))


def buffer_bytes(config: Config, node_ram: int, processes_per_node: int) -> int:
    """The host buffer one process's checkpoint save may use: ``trainer.checkpoint_host_buffer_gb``, or with -1
    the node's share (:func:`host_buffer_bytes`)."""
    return host_buffer_bytes(config.trainer.checkpoint_host_buffer_gb, node_ram, processes_per_node)


def save_staging(config: Config, state: int, node_ram: int, processes_per_node: int, largest_shard: int,
                 on_gpu: bool) -> dict[str, int]:
    """What a save stages in one process's host RAM: the whole state with ``checkpoint_async``, else at most
    the buffer. On CPU a piece is copied into the buffer only out of a tensor larger than a piece (half the
    buffer; :mod:`easytrain.distributed.checkpoint`): with every shard (``largest_shard`` bytes at most)
    smaller, nothing is staged."""
    if config.trainer.checkpoint_async:
        return {"checkpoint staging (async: the whole state)": state}
    buffer = buffer_bytes(config, node_ram, processes_per_node)
    if not on_gpu and largest_shard <= max(MIN_PIECE, buffer // 2):
        return {}
    return {"checkpoint staging (buffer)": min(state, buffer)}


def run_phases(config: Config, *, kept: dict[str, int], resumed: dict[str, int], state: int,
               trainable: int, largest_tensor: int, largest_shard: int, total_params: int, per_node: int,
               processes_per_node: int, node_ram: int, on_gpu: bool, rl: bool, device: dict[str, int],
               savers_per_node: Optional[int] = None, others: Optional[dict[str, list[tuple[int, dict[str, int]]]]] = None,
               saver_pages: int = 0, driver_pages: int = 0) -> list[Row]:
    """The checkpoint save, resume load and export rows. ``kept`` is what one worker process keeps in host RAM
    between steps (on CPU: every tensor), ``resumed`` what it holds when it resumes (before any step or sync:
    on CPU without an engine's weights or object store pages), ``state`` the bytes of its share
    of the checkpoint (fp32 parameters and optimizer moments), ``trainable`` those of its trainable parameter
    shards (fp32), ``largest_shard`` the bytes of its largest shard, ``device`` what its GPU holds between
    steps. A resume runs right after the load, before any weight sync (an engine's weights are still the
    checkpoint file's mapped pages); the load holds a copy of the trainable shards (the optimizer's state dict
    read into: a LoRA resume measured none for the frozen base) and one tensor in flight.
    ``savers_per_node`` processes per node save and resume (default: every one of ``processes_per_node``);
    ``others`` lists, per phase, the other worker processes (how many per node, what each holds) beside them:
    with split pools the reference's and the engine's. A save comes after steps: every saving process keeps
    ``saver_pages`` of the object store (:func:`batch_pages`), the driver ``driver_pages`` (:func:`store_pages`);
    a resume comes before any. The export holds the base model in fp32, an adapter export too."""
    rows = []
    kept = {**kept, "object store pages (batches)": saver_pages}
    staged = save_staging(config, state, node_ram, per_node, largest_shard, on_gpu)
    for phase, held in (("checkpoint_save", {**kept, **staged}),
                        ("resume_load", {**resumed, "checkpoint read (trainable shards, a tensor in flight)":
                                         trainable + largest_tensor * FP32})):
        process = worker_process(phase, held, on_gpu)
        bystanders = [(count, worker_process("idle", what, on_gpu)) for count, what in (others or {}).get(phase, [])]
        pages = {"object store pages (driver)": driver_pages} if phase == "checkpoint_save" else {}
        host = node_host(config, phase, [(savers_per_node or processes_per_node, process), *bystanders], rl, pages)
        on_device = dict(device) if on_gpu else held  # on CPU the device is the process's own memory
        rows.append(Row(phase, "all", sum_parts(on_device), sum_parts(host), on_device, host, sum_parts(process)))
    adapter = config.model.lora.rank > 0  # easytrain export without --merge writes the adapter alone
    export = {"export process": EXPORT_ADAPTER_PROCESS_BYTES if adapter else EXPORT_PROCESS_BYTES,
              "model (fp32)": total_params * FP32}
    rows.append(Row("export", "export", 0, sum_parts(export), {}, export, sum_parts(export)))
    return rows
