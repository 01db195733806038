"""DeepSpeed ZeRO (stages 1-3) behind :class:`~easytrain.distributed.strategy.TrainStrategy`.

The caller's loop is the one it runs with FSDP2: ``zero_grad()``, one
``backward(loss)`` per micro batch (as many as it likes, already scaled for a
global token mean with gradients averaged over the ranks), then ``step()``.
DeepSpeed's ``managed_gradient_accumulation: false`` makes that loop real:
``backward`` only accumulates (ZeRO-2/3 reduce-scatter into the gradient
partitions as they go, ZeRO-1 keeps local gradients) and ``engine.step()`` is
the accumulation boundary, whatever the number of backward calls before it.
``gradient_accumulation_steps`` stays 1 so DeepSpeed never rescales the loss,
and there is no loss scaler (fp32, or bf16 with fp32 master weights).

The optimizer is the same torch AdamW as FSDP's (:func:`build_optimizer`),
handed to ``deepspeed.initialize``; the LR schedule is stepped here rather
than by the engine, because the engine skips the schedule on a skipped
(non-finite) step and FSDP does not. Checkpoints are DeepSpeed's own files
plus small JSON ones, all under ``folder``:

    <folder>/latest                                   "zero" (for DeepSpeed's zero_to_fp32.py)
    <folder>/zero/mp_rank_00_model_states.pt          module states / shapes (rank 0)
    <folder>/zero/*zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r's fp32 partitions and Adam states
    <folder>/zero_to_fp32.py                          DeepSpeed's offline converter
    <folder>/deepspeed.json                           world size and ZeRO stage (rank 0)
    <folder>/scheduler.json, rng_rank<r>.json         as the FSDP checkpoints

DeepSpeed writes these files with ``torch.save``, so
``trainer.checkpoint_host_buffer_gb`` does not bound them: from a GPU each flat
partition (a rank's fp32 weights, or one Adam moment) is copied to the host
whole while it is written; with ``offload_optimizer`` they are already there
and written in place. The written pages are dropped from the page cache, as for
FSDP. Background saves (``trainer.checkpoint_async``) are FSDP's only.

ZeRO partitions depend on the world size, so a checkpoint resumes only on the
same number of ranks; :func:`deepspeed_state_dict` turns one into full fp32
weights in a single process (for ``easytrain export``).

DeepSpeed reads its files back with ``torch.load(weights_only=False)``, which
unpickles (runs) whatever a file holds. Both loads here (:meth:`DeepSpeedStrategy.load`
and :func:`deepspeed_state_dict`) run under :func:`weights_only_loads`:
torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` turns each of DeepSpeed's loads into
a weights-only one that builds tensors, containers and the three DeepSpeed
classes its state holds (:func:`deepspeed_safe_globals`), and refuses the rest.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from easytrain.config.schema import ActorConfig
from easytrain.distributed.checkpoint import (IncompatibleCheckpoint, UnsafeCheckpoint, drop_file_pages, read_json,
                                              rng_state, set_rng_state, write_json)
from easytrain.distributed.strategy import TrainStrategy, build_optimizer

logger = logging.getLogger(__name__)

CHECKPOINT_TAG = "zero"
"""Sub-folder of a strategy checkpoint holding DeepSpeed's files (its ``tag``)."""
META_FILE = "deepspeed.json"
"""Marks a folder as a DeepSpeed checkpoint; holds the world size and ZeRO stage it was saved with."""
COMPUTE_DTYPES = ("float32", "bfloat16")


def deepspeed_config(cfg: ActorConfig, compute_dtype: str, on_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed config dict for the actor's settings (raises ``ValueError`` on an unsupported one)."""
    ds = cfg.deepspeed
    if ds.zero_stage not in (1, 2, 3):
        raise ValueError(f"worker.actor.deepspeed.zero_stage={ds.zero_stage}: the DeepSpeed strategy supports ZeRO "
                         "stages 1-3 (for plain data parallelism use worker.actor.strategy=fsdp)")
    if ds.offload_params and ds.zero_stage != 3:
        raise ValueError(f"worker.actor.deepspeed.offload_params needs zero_stage=3 (got {ds.zero_stage}): only "
                         "ZeRO-3 partitions parameters; use offload_optimizer for stages 1-2")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"model.dtype={compute_dtype} with worker.actor.strategy=deepspeed: use one of "
                         f"{', '.join(COMPUTE_DTYPES)} (float16 needs DeepSpeed's loss scaling, which is not used)")
    zero: dict[str, Any] = {"stage": ds.zero_stage, "compute_grad_norm": True}  # step() returns it
    offload = {"device": "cpu", "pin_memory": on_gpu}  # pinning needs an accelerator
    if ds.offload_optimizer:
        zero["offload_optimizer"] = dict(offload)
    if ds.offload_params:
        zero["offload_param"] = dict(offload)
    return {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: the caller chooses its micro batches
        "gradient_accumulation_steps": 1,  # > 1 would divide every loss by it
        "managed_gradient_accumulation": False,  # step() is the boundary, after any number of backward calls
        "gradient_clipping": cfg.optim.max_grad_norm,  # 0 = off
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch AdamW
        "zero_force_ds_cpu_optimizer": False,  # its CPUAdam is a C++ op, not built everywhere
        "bf16": {"enabled": compute_dtype == "bfloat16", "check_grad_overflow": True},
        "fp16": {"enabled": False},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def set_local_rank(device: torch.device) -> None:
    """DeepSpeed takes its device from LOCAL_RANK (set by its launcher or torchrun, not by Ray workers)."""
    if device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(device.index or 0)
    else:
        os.environ.setdefault("LOCAL_RANK", "0")


@contextmanager
def zero3_construction(cfg: Any, compute_dtype: str, device: torch.device) -> Iterator[bool]:
    """With ZeRO-3, models built inside this context are partitioned across the ranks as transformers constructs
    them (``deepspeed.zero.Init``, which transformers enters while an ``HfDeepSpeedConfig`` is alive; weights are
    then loaded a parameter at a time into the partitions) instead of whole in every process first: a 32B model
    is 128 GB in fp32, once per GPU otherwise. Yields whether it applies. The config is dropped on leaving, so a
    reference model built later in the same process (fused workers) is not partitioned by DeepSpeed."""
    if getattr(cfg, "strategy", "fsdp") != "deepspeed" or cfg.deepspeed.zero_stage != 3:  # (the actor's keys)
        yield False
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    set_local_rank(device)
    alive = HfDeepSpeedConfig(deepspeed_config(cfg, compute_dtype, on_gpu=device.type == "cuda"))
    try:
        yield True
    finally:
        unset_hf_deepspeed_config()
        del alive


def parameter_count(param: torch.Tensor) -> int:
    """Elements of a parameter, also of one ZeRO-3 partitioned at construction (whose local tensor is empty)."""
    return int(getattr(param, "ds_numel", param.numel()))


class DeepSpeedStrategy(TrainStrategy):
    """ZeRO 1-3 through a DeepSpeed engine; ``model`` is the engine (its ``module`` is the transformers model).

    ``compute_dtype`` is ``model.dtype``: float32 trains in fp32, bfloat16 runs forward and backward in bf16 with
    fp32 master weights and optimizer states. The model passed in is in fp32 (whole, or with ZeRO-3 partitioned at
    construction: :func:`zero3_construction`), frozen parts already ``requires_grad=False``.
    """

    def __init__(self, model: nn.Module, cfg: ActorConfig, total_steps: int, *,
                 compute_dtype: str = "float32") -> None:
        import deepspeed

        self.cfg = cfg
        self.zero_stage = cfg.deepspeed.zero_stage
        device = next(model.parameters()).device
        config = deepspeed_config(cfg, compute_dtype, on_gpu=device.type == "cuda")
        if not dist.is_initialized():
            raise RuntimeError("DeepSpeedStrategy needs torch.distributed initialised by the worker first")
        set_local_rank(device)
        self.optimizer, self.scheduler = build_optimizer([p for p in model.parameters() if p.requires_grad],
                                                         cfg.optim, total_steps)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=config,
                                               dist_init_required=False)
        self.engine = engine
        self.model = engine
        self.accumulating = False  # backward calls were made since the last step or zero_grad
        self.world_size = dist.get_world_size()
        logger.info("DeepSpeed ZeRO-%d on %d ranks (%s, offload params=%s optimizer=%s)", self.zero_stage,
                    self.world_size, compute_dtype, cfg.deepspeed.offload_params, cfg.deepspeed.offload_optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        self.accumulating = True

    def step(self) -> float:
        self.engine.step()
        self.accumulating = False
        norm = self.engine.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        if not self.engine.was_step_applied():
            logger.warning("actor: non-finite gradient norm %s, optimizer step skipped", norm)
        self.scheduler.step()
        self.zero_grad()
        return norm

    def zero_grad(self) -> None:
        """Drop the gradients, also those of backward calls not followed by a step (an abandoned accumulation)."""
        if self.accumulating and self.zero_stage == 2:
            self._drop_reduced_gradients()
        self.accumulating = False
        # ZeRO-3's zero_grad also restarts its micro-step count, so the next backward overwrites its gradient
        # partitions instead of adding to them; ZeRO-1 only reduces in step(), so dropping .grad is enough.
        self.engine.optimizer.zero_grad(set_to_none=True)
        self.engine.zero_grad()

    def _drop_reduced_gradients(self) -> None:
        """ZeRO-2 keeps the gradient partitions reduced so far through ``zero_grad`` and has no call to drop them.
        A step whose gradients are NaN takes DeepSpeed's overflow path, which discards them and skips the update:
        weights, optimizer states and the LR schedule stay as they are. Collective, like every backward."""
        logger.info("actor: dropping a partial ZeRO-2 gradient accumulation")
        poison = torch.stack([(p * float("nan")).sum() for p in self.trainable()]).sum()
        self.engine.backward(poison)
        self.engine.step()

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ checkpoints

    def save(self, folder: Path, rank: int, *, buffer_bytes: Optional[int] = None,
             background: bool = False) -> None:
        """Collective: DeepSpeed's per-rank files, then the schedule, the world size and this rank's RNG. Its
        ``torch.save`` calls are not bounded by ``buffer_bytes`` (see the module's docstring)."""
        if background:
            raise ValueError("trainer.checkpoint_async=true needs worker.actor.strategy=fsdp")
        folder.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, save_latest=True)
        for path in sorted((folder / CHECKPOINT_TAG).iterdir()):
            if f"pp_rank_{rank}_" in path.name or (rank == 0 and "pp_rank_" not in path.name):  # rank 0: the module
                drop_file_pages(path)
        if rank == 0:
            write_json(folder / "scheduler.json", self.scheduler.state_dict())
            write_json(folder / META_FILE, {"world_size": self.world_size, "zero_stage": self.zero_stage})
        write_json(folder / f"rng_rank{rank}.json", rng_state())

    def load(self, folder: Path, rank: int) -> dict[str, Any]:
        """Collective counterpart of :meth:`save`; refuses a checkpoint of another world size or format."""
        meta = checkpoint_meta(folder)
        if meta["world_size"] != self.world_size:
            raise IncompatibleCheckpoint(
                f"{folder}: DeepSpeed checkpoint saved by {meta['world_size']} ranks, this run has {self.world_size}; "
                "ZeRO partitions depend on the world size, so resume with the same number of actor ranks (or export "
                "the weights with `easytrain export` and start a new run from them)")
        if meta["zero_stage"] != self.zero_stage:
            raise IncompatibleCheckpoint(f"{folder}: saved with ZeRO-{meta['zero_stage']}, this run uses "
                                         f"ZeRO-{self.zero_stage} (worker.actor.deepspeed.zero_stage)")
        with weights_only_loads(folder):
            path, _ = self.engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                                  load_lr_scheduler_states=False)
        if path is None:
            raise IncompatibleCheckpoint(f"{folder}: DeepSpeed found no checkpoint under tag {CHECKPOINT_TAG!r}")
        self.scheduler.load_state_dict(read_json(folder / "scheduler.json"))
        rng_file = folder / f"rng_rank{rank}.json"
        if rng_file.exists():
            set_rng_state(read_json(rng_file))
        return {"saved_ranks": meta["world_size"], "rng_restored": rng_file.exists()}

    # ------------------------------------------------------------------ weights

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights in the module's own names on CPU, on rank 0 (empty elsewhere, like FSDP's
        ``cpu_offload`` full state dict); every rank must call it. ZeRO-3 gathers one tensor at a time. Under
        bf16 compute the trainable weights are the fp32 masters (the module holds bf16 copies)."""
        module = self.engine.module
        keep = dist.get_rank() == 0
        masters = self.engine.bfloat16_enabled()
        out: dict[str, torch.Tensor] = {}
        done: dict[int, str] = {}  # tied weights appear under two names; gather them once
        for name, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) in done:
                if keep:
                    out[name] = out[done[id(tensor)]]
                continue
            done[id(tensor)] = name
            value = self._full_tensor(tensor, master=masters and tensor.requires_grad)  # collective, same order
            if keep:
                out[name] = value.detach().to("cpu", torch.float32, copy=True)
        return out

    def _full_tensor(self, tensor: torch.Tensor, master: bool) -> torch.Tensor:
        if master:
            from deepspeed.utils import safe_get_full_fp32_param

            full = safe_get_full_fp32_param(tensor)
            if full is not None:
                return full
        if hasattr(tensor, "ds_id"):  # a ZeRO-3 partitioned parameter
            import deepspeed

            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                return tensor.data.to("cpu", copy=True)
        return tensor.data


def is_deepspeed_checkpoint(folder: Path) -> bool:
    return (folder / META_FILE).is_file()


def checkpoint_meta(folder: Path) -> dict[str, Any]:
    if not is_deepspeed_checkpoint(folder):
        raise IncompatibleCheckpoint(f"{folder}: not a DeepSpeed checkpoint (no {META_FILE}); was it saved with "
                                     "worker.actor.strategy=fsdp?")
    return read_json(folder / META_FILE)


def deepspeed_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights (module names, on CPU) of a checkpoint written by :meth:`DeepSpeedStrategy.save`, in one
    process with no process group, whatever number of ranks saved it (DeepSpeed's zero_to_fp32)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoint_meta(folder)
    with weights_only_loads(folder):
        state = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=CHECKPOINT_TAG)
    return {name: tensor.float().contiguous() for name, tensor in state.items()}


FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def deepspeed_safe_globals() -> list[Any]:
    """The classes DeepSpeed 0.19's ZeRO 1-3 checkpoints pickle besides tensors and containers (found by loading
    every stage's files, fp32 and bf16, with a recording unpickler): building them runs no code."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def weights_only_loads(folder: Path) -> Iterator[None]:
    """Every ``torch.load`` inside (DeepSpeed's own, which pass ``weights_only=False``) made weights-only, with
    :func:`deepspeed_safe_globals` allowed; a file holding anything else is an :class:`UnsafeCheckpoint` naming
    it, and nothing of it runs. The variable is this process's for the duration (loads are not concurrent)."""
    saved = {name: os.environ.pop(name, None) for name in (FORCE_WEIGHTS_ONLY, FORCE_NO_WEIGHTS_ONLY)}
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            yield
    except pickle.UnpicklingError as err:
        detail = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                      str(err).splitlines()[0] if str(err) else "").rstrip(".")
        raise UnsafeCheckpoint(f"{folder}: refused to load DeepSpeed state that holds more than tensors ({detail}); "
                               "a checkpoint written by easytrain never does, and unpickling it could run code: "
                               "load only checkpoints you trust (docs/checkpoints.md, Trust)") from None
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
