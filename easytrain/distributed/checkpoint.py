"""Sharded training state on disk: torch distributed checkpoint (DCP) plus small JSON files.

Every rank of a training role calls :func:`save_training_state` with the same
folder; each writes its own shards (``__<rank>_0.distcp``) and rank 0 the
DCP metadata, the optimizer's hyper-parameters and the LR scheduler, so a
shared filesystem (or one machine) ends up with one complete folder:

    <folder>/.metadata                 DCP index (written by torch)
    <folder>/__<rank>_0.distcp         this rank's model and optimizer shards
    <folder>/param_groups.json         optimizer hyper-parameters (lr, betas, ...)
    <folder>/scheduler.json            LR scheduler state
    <folder>/rng_rank<r>.json          each rank's RNG states

Only tensors go through DCP (read back with ``torch.load(weights_only=True)``
by torch); everything else is JSON, so loading a checkpoint never unpickles
objects. DCP stores global shapes and offsets, so a folder saved by N ranks
loads on M ranks (FSDP2 shards or plain tensors alike).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

logger = logging.getLogger(__name__)


class IncompatibleCheckpoint(RuntimeError):
    """A checkpoint's tensors do not fit the model being loaded; the message names the tensor."""


# ----------------------------------------------------------------------------- JSON and RNG


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON and fsync it, so a rename after it publishes complete bytes."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: Path) -> Any:
    with open(path) as f:
        return json.load(f)


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _decode(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's RNG states (python, torch CPU, CUDA when present) as JSON-able values."""
    state: dict[str, Any] = {"python": _tuples_to_lists(random.getstate()), "torch": _encode(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_decode(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])


def _tuples_to_lists(x: Any) -> Any:
    return [_tuples_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


# ----------------------------------------------------------------------------- training state


def save_training_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                        rank: int) -> None:
    """Collective: every rank of the model's process group calls this with the same ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    groups = optim_sd.pop("param_groups")
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=FileSystemWriter(folder, sync_files=True))
    if rank == 0:
        write_json(folder / "param_groups.json", groups)
        write_json(folder / "scheduler.json", scheduler.state_dict())  # LambdaLR's functions show as null
    write_json(folder / f"rng_rank{rank}.json", rng_state())


def load_training_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                        rank: int) -> dict[str, Any]:
    """Collective counterpart of :func:`save_training_state`; reshards to this group's layout."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # also creates the optimizer states to load into
    groups = optim_sd.pop("param_groups")
    check_tensors(folder, {"model": model_sd, "optim": optim_sd})
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=FileSystemReader(folder))
    saved_groups = read_json(folder / "param_groups.json")
    if len(saved_groups) != len(groups):
        raise IncompatibleCheckpoint(f"{folder}: {len(saved_groups)} optimizer parameter groups saved, "
                                     f"{len(groups)} now")
    for group, saved in zip(groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
    state["optim"]["param_groups"] = groups
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(read_json(folder / "scheduler.json"))
    rng_file = folder / f"rng_rank{rank}.json"
    if rng_file.exists():
        set_rng_state(read_json(rng_file))
    saved_ranks = len(list(folder.glob("rng_rank*.json")))
    return {"saved_ranks": saved_ranks, "rng_restored": rng_file.exists()}


def load_model_weights(folder: Path, model: nn.Module) -> None:
    """Load only the model's tensors of a training-state folder into ``model`` (one process, no group)."""
    model_sd = get_model_state_dict(model)
    check_tensors(folder, {"model": model_sd})
    state = {"model": model_sd}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(folder), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


def check_tensors(folder: Path, state: dict[str, Any]) -> None:
    """Refuse a checkpoint whose tensors do not match ``state`` by name and global shape, naming the first
    difference (DCP's own error for this is a stack of per-rank traces)."""
    if not (folder / ".metadata").exists():
        raise IncompatibleCheckpoint(f"{folder}: no DCP metadata (.metadata); not a complete checkpoint")
    saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    wanted = dict(_flatten(state))
    for key, shape in wanted.items():
        meta = saved.get(key)
        if meta is None:
            raise IncompatibleCheckpoint(f"{folder} has no tensor {key!r}: the checkpoint was written for another "
                                         "model or LoRA setting")
        saved_shape = tuple(getattr(meta, "size", ()))
        if shape is not None and saved_shape != shape:
            raise IncompatibleCheckpoint(f"{folder}: tensor {key!r} has shape {list(saved_shape)} in the checkpoint "
                                         f"and {list(shape)} in this model")
    extra = sorted(k for k in saved if k.startswith("model.") and k not in wanted)
    if extra:
        raise IncompatibleCheckpoint(f"{folder} holds {len(extra)} model tensor(s) this model lacks, "
                                     f"e.g. {extra[0]!r}")


def _flatten(obj: Any, prefix: str = "") -> Any:
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name + ".")
        elif torch.is_tensor(value):
            yield name, tuple(value.shape)  # a DTensor reports its global shape


def distcp_files(folder: Path) -> list[str]:
    """The shard files in a DCP folder (one per saving rank)."""
    return sorted(p.name for p in folder.glob("*.distcp"))


def saved_world_size(folder: Path) -> Optional[int]:
    n = len(list(folder.glob("rng_rank*.json")))
    return n or None
