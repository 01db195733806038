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
by torch); everything else is JSON. DCP's index (``.metadata``) is a pickle:
:class:`SafeReader` reads it with :class:`MetadataUnpickler`, which builds
only DCP's own metadata classes, ``torch.Size``, dtypes and layouts, and
refuses a shard file outside the folder; :class:`TensorsOnlyPlanner` refuses
the non-tensor entries DCP would ``torch.load`` with ``weights_only=False``.
DCP stores global shapes and offsets, so a folder saved by N ranks loads on
M ranks (FSDP2 shards or plain tensors alike).

A save holds a bounded amount of host memory (``trainer.checkpoint_host_buffer_gb``):
:class:`PiecePlanner` cuts every tensor into pieces of at most half the buffer
(more DCP chunks of the same tensors: the folder's format does not change), and
:class:`PieceWriter` copies one piece at a time from the device (or out of a
larger CPU tensor) into one reused host buffer of that size, writes it, and
pushes the written pages out of the page cache before another piece's worth
accumulates. DCP's own writer keeps every tensor it copied to the host until
the rank's file is complete: on GPUs the whole local state (copied with
``non_blocking``, so into pinned blocks of torch's host allocator, which it
rounds up to powers of two and keeps cached), and on CPU every view it cloned.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import os
import pickle
import random
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
# DCP's own record writer and file suffix: the pieces are written exactly as FileSystemWriter writes its items
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (ReadItem, SavePlan, SavePlanner, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.futures import Future

from easytrain.memory.host import MIN_PIECE

logger = logging.getLogger(__name__)


class IncompatibleCheckpoint(RuntimeError):
    """A checkpoint's tensors do not fit the model being loaded; the message names the tensor."""


class UnsafeCheckpoint(IncompatibleCheckpoint):
    """A checkpoint file holds something other than tensors and their index (a pickled object that loading would
    have to run); nothing of it was run."""


# ----------------------------------------------------------------------------- reading DCP's index safely


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = {
    (_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                       "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                       "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided"): a table lookup
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id: the folder it was saved to
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}
"""What torch 2.13's DCP pickles into ``.metadata`` (found by unpickling the index of FSDP2, plain, fp32 and bf16
saves with a recording unpickler), besides dtypes (``torch.float32`` ...): nothing here runs code when built."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file building only :data:`METADATA_GLOBALS` and torch dtypes: a pickle
    naming anything else (``os.system``, ``builtins.eval``, a class whose construction runs code) is refused
    before that object exists."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{module}.{name}")


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader with the index read by :class:`MetadataUnpickler`, and every shard it names a file
    directly in the folder (a ``../`` path would read a file elsewhere as tensor bytes)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        except UnsafeCheckpoint as err:
            raise UnsafeCheckpoint(f"{path}: refused to load: the DCP index names {err}, which a checkpoint "
                                   "written by easytrain never holds and which could run code; load only "
                                   "checkpoints you trust (docs/checkpoints.md, Trust)") from None
        except Exception as err:  # noqa: BLE001 - whatever a damaged pickle raises: unpickling errors, EOF, ...
            raise IncompatibleCheckpoint(f"{path}: not a readable DCP index ({type(err).__name__}: {err}); the "
                                         "checkpoint is damaged or was not written by torch's DCP") from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        for info in (metadata.storage_data or {}).values():
            name = str(getattr(info, "relative_path", ""))
            if not name or Path(name).name != name or name in (".", ".."):
                raise UnsafeCheckpoint(f"{path}: names the shard file {name!r}, which is not a file of "
                                       f"{path.parent}; refused")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load plan for state dicts of tensors only: an entry stored as bytes would be unpickled by
    ``torch.load(weights_only=False)``, so it is refused (easytrain saves no such entry)."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise UnsafeCheckpoint(f"{read_item.dest_index.fqn!r} is stored as a pickled object, not a tensor; "
                               "refused (easytrain's checkpoints hold only tensors there)")


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


# ----------------------------------------------------------------------------- host memory of a save


DEFAULT_BUFFER_BYTES = 2**30
"""The host buffer of a save when no config gives one (tests, tools)."""
# the buffer's size (trainer.checkpoint_host_buffer_gb, or the node's share: easytrain.memory.host.host_buffer_bytes)
# and the smallest piece (MIN_PIECE) are the memory plan's rule, kept with the plan


def agreed_piece_bytes(buffer_bytes: int) -> int:
    """Half the buffer, the same on every rank (the smallest rank's): a tensor replicated on several ranks must be
    cut the same way everywhere for DCP to write it once. Collective when a process group is up."""
    piece = max(MIN_PIECE, buffer_bytes // 2)
    if dist.is_initialized() and dist.get_world_size() > 1:
        agreed = torch.tensor([piece], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        piece = int(agreed)
    return piece


Box = tuple[list[int], list[int]]
"""Offsets and sizes of a piece of a tensor."""


def _boxes(offsets: list[int], sizes: list[int], itemsize: int, limit: int) -> Iterator[Box]:
    """Cut the box ``offsets``/``sizes`` of a tensor into boxes of at most ``limit`` bytes: runs of the first
    dimension longer than 1, and where one index of it is still too big, of the next (a single element is the
    smallest piece)."""
    nbytes = math.prod(sizes) * itemsize
    long_dims = [d for d, n in enumerate(sizes) if n > 1]
    if nbytes <= limit or not long_dims:
        yield offsets, sizes
        return
    dim = long_dims[0]
    per = max(1, limit // (nbytes // sizes[dim]))
    for start in range(0, sizes[dim], per):
        box_offsets, box_sizes = list(offsets), list(sizes)
        box_offsets[dim] += start
        box_sizes[dim] = min(per, sizes[dim] - start)
        yield from _boxes(box_offsets, box_sizes, itemsize, limit)


def _item_bytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return math.prod(item.tensor_data.chunk.sizes) * torch._utils._element_size(item.tensor_data.properties.dtype)


class PiecePlanner(DefaultSavePlanner):
    """DCP's default save plan with every tensor item larger than ``piece_bytes`` cut into chunks of at most that
    size. A chunk is what DCP already stores for a shard (global offsets and sizes), so loading needs nothing new
    and reshards from any number of ranks as before."""

    def __init__(self, piece_bytes: int) -> None:
        super().__init__()
        self.piece_bytes = piece_bytes
        self.sources: dict[MetadataIndex, tuple[MetadataIndex, list[int], list[int]]] = {}
        """A piece's index -> (its tensor's index in the state dict, the piece's offsets in it, its sizes)."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or _item_bytes(item) <= self.piece_bytes:
                items.append(item)
                continue
            data = item.tensor_data
            assert data is not None
            base = list(data.chunk.offsets)
            itemsize = torch._utils._element_size(data.properties.dtype)
            for offsets, sizes in _boxes(base, list(data.chunk.sizes), itemsize, self.piece_bytes):
                index = MetadataIndex(item.index.fqn, offsets)
                self.sources[index] = (item.index, [o - b for o, b in zip(offsets, base)], sizes)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                items.append(WriteItem(index=index, type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk, data.properties, data.size)))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        source = self.sources.get(write_item.index)  # the index hint DCP adds does not take part in ==
        if source is None:
            return super().resolve_data(write_item)
        index, offsets, sizes = source
        tensor = self.lookup_object(index)
        for dim, (start, length) in enumerate(zip(offsets, sizes)):
            if length != tensor.size(dim):
                tensor = tensor.narrow(dim, start, length)
        return tensor


class HostStaging:
    """One host buffer of ``nbytes`` that every piece needing a copy is copied into in turn: from a device, or out
    of a CPU storage larger than the piece (``torch.save`` writes a tensor's whole storage). A buffer reused
    rather than a tensor per piece, because freed pieces need not leave the process: glibc keeps blocks under its
    mmap threshold (up to 32 MiB) in the heap, where the next piece may not fit beside what came in between."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffer: Optional[numpy.ndarray] = None  # pages become resident as pieces first touch them

    def hold(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as a CPU tensor whose storage is exactly its bytes: itself when it is one already, else a
        copy in the buffer (valid until the next call)."""
        tensor = tensor.detach()
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() == nbytes:
            return tensor
        if nbytes > self.nbytes:  # not from PiecePlanner: copied whole
            return tensor.to("cpu", copy=True, memory_format=torch.contiguous_format)
        if self.buffer is None:
            self.buffer = numpy.empty(self.nbytes, dtype=numpy.uint8)
        # from_numpy gives the piece a storage of its own bytes; a blocking copy, into pageable memory (a
        # non_blocking one would pin a block per piece, which torch's host allocator then keeps)
        piece = torch.from_numpy(self.buffer[:nbytes]).view(tensor.dtype).view(tensor.shape)
        return piece.copy_(tensor)


def drop_written_pages(fd: int) -> None:
    """Flush ``fd`` to disk and drop its pages from the page cache, which counts in a container's memory (the
    figure Kubernetes and Ray's memory monitor read); written pages would otherwise stay until evicted."""
    os.fsync(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def drop_file_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_written_pages(fd)
    finally:
        os.close(fd)


class PieceWriter(FileSystemWriter):
    """DCP's FileSystemWriter (one ``__<rank>_0.distcp`` per rank, the same records), writing one piece at a time
    with at most ``piece_bytes`` of copied tensor data and ``piece_bytes`` of written, not yet dropped, file pages:
    the host memory of a save beyond the step's own stays within ``2 * piece_bytes``."""

    def __init__(self, path: Path, piece_bytes: int) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.piece_bytes = piece_bytes

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        items = sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)  # as DCP: small objects first
        results: list[WriteResult] = []
        staging = HostStaging(self.piece_bytes)
        with open(Path(self.path) / name, "wb") as stream:
            unsynced = 0
            for item in items:
                size = 0 if item.type == WriteItemType.BYTE_IO else _item_bytes(item)
                if unsynced and unsynced + size > self.piece_bytes:
                    stream.flush()
                    drop_written_pages(stream.fileno())
                    unsynced = 0
                data = planner.resolve_data(item)
                if torch.is_tensor(data):
                    data = staging.hold(data)
                results.append(_write_item(self.transforms, stream, data, item, name, self.serialization_format))
                unsynced += size
            stream.flush()
            drop_written_pages(stream.fileno())
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future


def local_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in a (nested) state dict: its shards of DTensors."""
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += local_bytes(value)
        elif torch.is_tensor(value):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


class BackgroundSave:
    """A save being written by a thread (``save_training_state(background=True)``)."""

    def __init__(self, future: Any, staged_bytes: int) -> None:
        self.future, self.staged_bytes = future, staged_bytes
        self.started = time.perf_counter()
        self.finished: Optional[float] = None
        future.add_done_callback(self._finish)

    def _finish(self, _: Any) -> None:
        self.finished = time.perf_counter()

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> dict[str, float]:
        """Block until written; re-raises the write's failure. Seconds the write took, host bytes staged."""
        self.future.result()
        finished = self.finished or time.perf_counter()
        return {"write_s": finished - self.started, "staged_gb": self.staged_bytes / 2**30}


# ----------------------------------------------------------------------------- training state


def save_training_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                        rank: int, *, buffer_bytes: Optional[int] = None, background: bool = False,
                        process_group: Optional[dist.ProcessGroup] = None) -> Optional[BackgroundSave]:
    """Collective: every rank of the model's process group calls this with the same ``folder``.

    The tensors are written in pieces of at most ``buffer_bytes / 2`` (see the module's docstring). With
    ``background`` the local state is first copied to host memory (a full copy: the price of not blocking), the
    call returns, and a thread writes the copy (DCP's ``async_save``; its collectives go over ``process_group``,
    which must be another group than the training's): wait on the returned :class:`BackgroundSave` before the
    folder is published. The small JSON files are written before the call returns either way.
    """
    folder.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    groups = optim_sd.pop("param_groups")
    state = {"model": model_sd, "optim": optim_sd}
    piece = agreed_piece_bytes(DEFAULT_BUFFER_BYTES if buffer_bytes is None else buffer_bytes)
    writer, planner = PieceWriter(folder, piece), PiecePlanner(piece)
    if rank == 0:
        write_json(folder / "param_groups.json", groups)
        write_json(folder / "scheduler.json", scheduler.state_dict())  # LambdaLR's functions show as null
    write_json(folder / f"rng_rank{rank}.json", rng_state())
    if not background:
        dcp.save(state, storage_writer=writer, planner=planner)
        return None
    start = time.perf_counter()
    future = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=process_group)
    staged = local_bytes(state)
    logger.info("rank %d: checkpoint staged in host memory (%.2f GB, %.1f s); writing it in the background", rank,
                staged / 2**30, time.perf_counter() - start)
    return BackgroundSave(future, staged)


def load_training_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                        rank: int) -> dict[str, Any]:
    """Collective counterpart of :func:`save_training_state`; reshards to this group's layout."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # also creates the optimizer states to load into
    groups = optim_sd.pop("param_groups")
    check_tensors(folder, {"model": model_sd, "optim": optim_sd})
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=SafeReader(folder), planner=TensorsOnlyPlanner())
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
        dcp.load(state, storage_reader=SafeReader(folder), planner=TensorsOnlyPlanner(),
                 no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


def check_tensors(folder: Path, state: dict[str, Any]) -> None:
    """Refuse a checkpoint whose tensors do not match ``state`` by name and global shape, naming the first
    difference (DCP's own error for this is a stack of per-rank traces)."""
    if not (folder / ".metadata").exists():
        raise IncompatibleCheckpoint(f"{folder}: no DCP metadata (.metadata); not a complete checkpoint")
    saved = SafeReader(folder).read_metadata().state_dict_metadata
    wanted = dict(_flatten(state))
    for key, shape in wanted.items():
        meta = saved.get(key)
        if meta is None:
            raise IncompatibleCheckpoint(f"{folder} has no tensor {key!r}: the checkpoint was written for another "
                                         "model or LoRA setting")
        if not isinstance(meta, TensorStorageMetadata):
            raise UnsafeCheckpoint(f"{folder}: {key!r} is stored as a pickled object, not a tensor; refused "
                                   "(easytrain's checkpoints hold only tensors there)")
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
