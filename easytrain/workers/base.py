"""Building blocks every role worker shares: process group, device, seeds, model building, memory readings."""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Optional

import psutil
import torch
import torch.distributed as dist
from torch import nn

from easytrain.config.schema import ActorConfig, Config, RoleConfig
from easytrain.distributed.deepspeed import DeepSpeedStrategy, zero3_construction
from easytrain.distributed.fsdp import apply_activation_checkpointing, apply_fsdp, build_mesh
from easytrain.distributed.group import Dispatch, dispatch, free_port
from easytrain.distributed.load import load_from_rank0
from easytrain.distributed.strategy import FSDPStrategy, TrainStrategy
from easytrain.distributed.ulysses import SequenceParallel, apply_ulysses, sequence_parallel_group
from easytrain.memory import peaks
from easytrain.workers.debug import WorkerDebug, debug_bases
from easytrain.memory.host import malloc_threshold_bytes
from easytrain.memory.readings import process_info, release_process_memory, torch_allocator
from easytrain.models.families import family_of
from easytrain.models.hf import load_model, model_folder
from easytrain.models.segments import apply_segment_attention
from easytrain.models.parts import apply_lora, freeze_parts

logger = logging.getLogger(__name__)

BACKEND = "cpu:gloo,cuda:nccl"
"""One process group for CPU and GPU tensors: the same code runs in CPU tests and on GPUs."""


PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)
"""How long a collective (and the rendezvous) waits for the slowest rank."""


def backend() -> str:
    """BACKEND, minus NCCL where torch was built without it (CPU wheels)."""
    return BACKEND if dist.is_nccl_available() else "cpu:gloo"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def node_cpus() -> int:
    """The cores this process may run on, shared among the Ray nodes started on this machine (a cluster of node
    processes on one host, as tests and benches use), or fewer if Ray was told the node has fewer (its
    --num-cpus; a larger logical count does not add cores)."""
    cores = len(os.sched_getaffinity(0))
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
            alive = [info for info in ray.nodes() if info.get("Alive")]
            me = next((info for info in alive if info["NodeID"] == node), None)
            if me is not None and me.get("Resources", {}).get("CPU"):
                same_host = sum(info.get("NodeManagerAddress") == me.get("NodeManagerAddress") for info in alive)
                return max(1, min(cores // max(1, same_host), int(me["Resources"]["CPU"])))
    except Exception as error:  # not inside Ray, or the GCS did not answer: the OS's count
        logger.debug("node CPUs from Ray unavailable (%s)", error)
    return cores


def worker_threads(config: Config) -> int:
    """trainer.threads_per_worker, or (0) this worker's share of the node's CPUs."""
    t = config.trainer
    if t.threads_per_worker:
        return t.threads_per_worker
    roles = 1 if t.colocate else 3
    return max(1, node_cpus() // (t.workers_per_node * roles))


def init_process(config: Config, role: str, rank: int, device: torch.device) -> None:
    """Logging, the device, the host allocator, the seed and the threads of a worker process."""
    logging.basicConfig(level=logging.INFO, format=f"[{role}{rank}] %(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-worker "Loading weights" bars would flood the driver's log
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threshold = malloc_threshold_bytes(config)
    if threshold and not peaks.fix_mmap_threshold(threshold):
        logger.warning("trainer.malloc_mmap_threshold_kb: this C library is not glibc; its allocator is left as is")
    torch.manual_seed(config.trainer.seed + 1000 * rank)
    torch.set_num_threads(worker_threads(config))


class WorkerBase(*debug_bases(WorkerDebug)):  # type: ignore[misc]
    """What a role worker is before it holds a model: its rank, device, seed and process group."""

    def __init__(self, config: Config, *, role: str, rank: int, world_size: int, hosted: bool = False) -> None:
        """``hosted``: a role inside a fused worker's process, which set the process up (:func:`init_process`)."""
        self.config, self.role, self.rank, self.world_size = config, role, rank, world_size
        self.device = torch.device("cuda", 0) if config.trainer.device == "cuda" else torch.device("cpu")
        if not hosted:
            init_process(config, role, rank, self.device)
        self.folder = model_folder(config.model)
        self.sp: Optional[SequenceParallel] = None
        """This rank's Ulysses group (``worker.<role>.ulysses_size`` > 1), set with the process group."""
        self._store: Optional[dist.TCPStore] = None
        """Rank 0's rendezvous store, held for the process group's life."""

    @dispatch(Dispatch.BROADCAST)
    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    @dispatch(Dispatch.BROADCAST)
    def free_port(self) -> int:
        return free_port()

    @dispatch(Dispatch.BROADCAST)
    def open_store(self) -> int:
        """Listen for the role's rendezvous (rank 0) and return the port: the store is open before any rank is
        told the port, so nothing else on the node can take it in between (as a port picked free and closed
        again can be: a CI run lost a test to EADDRINUSE that way)."""
        self._store = dist.TCPStore("0.0.0.0", 0, self.world_size, is_master=True, timeout=PROCESS_GROUP_TIMEOUT,
                                    wait_for_workers=False)
        return int(self._store.port)

    @dispatch(Dispatch.BROADCAST)
    def init_process_group(self, address: str, port: int) -> None:
        """Join the role's world at rank 0's store (:meth:`open_store`), which rank 0 holds itself."""
        store = self._store or dist.TCPStore(address, port, self.world_size, is_master=False,
                                             timeout=PROCESS_GROUP_TIMEOUT)
        dist.init_process_group(backend(), store=store, rank=self.rank, world_size=self.world_size,
                                timeout=PROCESS_GROUP_TIMEOUT)
        role = getattr(self.config.worker, self.role, None)
        size = getattr(role, "ulysses_size", 1) if self.role in ("actor", "ref") else 1
        if size > 1:
            self.sp = sequence_parallel_group(self.world_size, size, self.rank)
            logger.info("%s rank %d: Ulysses group of %d ranks (position %d)", self.role, self.rank, size,
                        self.sp.rank)

    @dispatch(Dispatch.BROADCAST)
    def memory(self) -> dict[str, Any]:
        """This process's memory: RSS now and its peak, the torch allocator's peak on GPU (step metrics), and
        under ``watch`` the watchdog's in-worker reading (RSS, allocated/reserved/peak bytes)."""

        import ray

        rss = psutil.Process(os.getpid()).memory_info().rss
        reading: dict[str, Any] = {"rss_gb": rss / 2**30, "peak_rss_gb": peaks.lifetime_peak() / 2**30}
        if self.device.type == "cuda":
            reading["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        reading["watch"] = {"role": self.role, "rank": self.rank, "node_ip": ray.util.get_node_ip_address(),
                            "rss_bytes": rss, **torch_allocator()}
        return reading

    @dispatch(Dispatch.BROADCAST)
    def phase_peaks(self) -> dict[str, Any]:
        """This process's host and device peak per dispatched method since the last call (the plan check's
        measurements: :mod:`easytrain.memory.peaks`), with where it runs and its RSS now."""
        import ray

        return {"role": self.role, "rank": self.rank, "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "rss_bytes": psutil.Process(os.getpid()).memory_info().rss, "peaks": peaks.drain()}

    @dispatch(Dispatch.BROADCAST)
    def process_info(self) -> dict[str, Any]:
        """Where this worker runs, for the memory watchdog's node samplers (and its collective backend)."""
        return {**process_info(self.role, self.rank), "backend": dist.get_backend() if dist.is_initialized() else None}

    @dispatch(Dispatch.BROADCAST)
    def release_memory(self) -> dict[str, Any]:
        """The watchdog's free_caches relief: garbage, the CUDA cache, glibc's free heap; measured."""
        return {"role": self.role, "rank": self.rank, **release_process_memory()}


def build_sharded_model(config: Config, role: RoleConfig, folder: str, device: torch.device,
                        world_size: int, trainable: bool, shard: bool = True,
                        sp: Optional[SequenceParallel] = None) -> nn.Module:
    """The role's model: loaded in fp32 master precision, frozen parts set, checkpointing, Ulysses attention
    when ``sp`` is given, then FSDP2 over all ranks (``shard=False`` leaves it whole for a strategy that
    distributes it itself: DeepSpeed).

    Sharded over several ranks, only rank 0 reads the checkpoint; the others build the model on the meta device
    and receive their shards, buffers and LoRA adapters from rank 0 (``distributed.load``): one full host copy
    per node at load, not one per process. One process (``world_size == 1``) loads the full model; ``shard=False``
    (DeepSpeed) too, except under ZeRO-3, where each rank builds only its partition (``zero3_construction``)."""
    model_cfg = config.model
    compute_dtype = DTYPES[model_cfg.dtype]
    param_dtype: Optional[torch.dtype] = None if compute_dtype == torch.float32 else compute_dtype
    offload = role.offload.params

    def prepare(model: nn.Module) -> nn.Module:  # the same steps, in the same order, on every rank
        getattr(model, "config").use_cache = False
        if model_cfg.dedupe_images:
            family_of(model).dedupe_images(model)  # each distinct image through the tower once
        if sp is not None:
            apply_ulysses(model, sp)
        elif device.type == "cuda" and model_cfg.attn_implementation == "sdpa":
            apply_segment_attention(model)  # packed and prompt-shared passes without an S x S mask on the GPU
            logger.info("attention: sdpa, packed samples and shared prompts attended one by one (no S x S mask)")
        if not trainable:
            model.requires_grad_(False)
            model.eval()
            return model
        freeze_parts(model, model_cfg.freeze_vision_tower, model_cfg.freeze_aligner, model_cfg.freeze_llm)
        if model_cfg.gradient_checkpointing:
            apply_activation_checkpointing(model)
        if model_cfg.lora.rank > 0:
            model = apply_lora(model, model_cfg.lora)
        return model

    def fsdp(model: nn.Module) -> None:
        mesh = build_mesh(device.type, world_size, role.fsdp.shard_size)
        apply_fsdp(model, mesh=mesh, reshard_after_forward=role.fsdp.full_shard, offload_params=offload,
                   param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                   device_type=device.type)

    if shard and world_size > 1:
        model = load_from_rank0(model_cfg, folder, prepare=prepare, shard=fsdp,
                                device=torch.device("cpu") if offload else device)
    else:
        with zero3_construction(role, model_cfg.dtype, device) if not shard else nullcontext():
            model = prepare(load_model(model_cfg, folder, dtype="float32"))
        if shard and (offload or param_dtype is not None):
            fsdp(model)
    if not offload:
        model.to(device)
    else:  # FSDP offloads parameters only: buffers (rotary inv_freq) compute where the activations are
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.device != device:
                    setattr(module, name, buffer.to(device))
    return model


def build_strategy(model: nn.Module, cfg: ActorConfig, total_steps: int,
                   compute_dtype: str = "float32") -> TrainStrategy:
    """The role's strategy for a model already built (and, for FSDP, sharded, its compute dtype set as mixed
    precision) by the worker; DeepSpeed takes ``compute_dtype`` (``model.dtype``) itself."""
    if cfg.strategy == "deepspeed":
        return DeepSpeedStrategy(model, cfg, total_steps, compute_dtype=compute_dtype)
    return FSDPStrategy(model, cfg, total_steps)
