"""Moving the actor's weights into the rollout engines, in place, in buckets, without disk.

The weights travel one bucket at a time (``worker.rollout.sync_bucket_mb``;
a module never splits, so LoRA adapters travel with their base weights).
Each actor rank puts its own FSDP shards of a bucket in Ray's object store
and hands the reference to every rollout rank; a rollout rank gathers the
full tensors from the parts (shards join along dim 0, read in place from
shared memory), renames them to HF names (PEFT prefixes stripped, LoRA
merged) and loads them into its engine, while the actor ranks put the next
bucket. No collective runs on the actor side: the object store does the
gather, at shared-memory speed within a node. At most two buckets are in
flight, so the extra memory a sync takes is bounded by the bucket, not by
the model. The driver makes one call; the buckets flow from the actor ranks
to the rollout workers directly. That path serves separate pools
(``trainer.colocate=false``) and nodes apart; fused workers (one process per
device hosting actor and engine) sync in-process instead
(:func:`sync_in_process`: FSDP shards gathered bucket by bucket into full
tensors on the device, in the engine's dtype, loaded into the engine there).

Tensors cross as numpy byte arrays (:func:`to_wire`): Ray stores numpy
buffers as they are and readers map them without copying.
:class:`AliveBytes` measures the bound at the receiver: the bytes of
assembled tensors still alive (released by the garbage collector, not by
bookkeeping) and their peak.
"""

from __future__ import annotations

import abc
import re
import threading
import time
import weakref
from typing import Any, Iterable, Mapping, Optional

import torch

from easytrain.distributed.group import WorkerGroup

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.default\.weight$")
_PEFT_PREFIX = "base_model.model."


def to_hf_names(state: dict[str, torch.Tensor], lora_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """HF names for a plain or PEFT-wrapped model's weights, with LoRA merged: W + scale * B @ A."""
    if not any(k.startswith(_PEFT_PREFIX) for k in state):
        return state
    out: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        match = _LORA.match(name)
        if match:
            lora.setdefault(match["module"], {})[match["ab"]] = tensor
            continue
        out[name.replace(".base_layer.", ".")] = tensor
    for module, pair in lora.items():
        weight = f"{module}.weight"
        out[weight] = out[weight] + lora_scale * (pair["B"].float() @ pair["A"].float()).to(out[weight].dtype)
    return out


def weights_to_send(model: torch.nn.Module, holds_frozen: bool) -> dict[str, torch.Tensor]:
    """The actor's state dict to sync (tied weights under every name: vLLM's layer-wise reload rebuilds each layer
    from the tensors it is given, so a tied lm_head sent only as embed_tokens would keep its old values), less the
    frozen weights (``requires_grad`` off: a frozen vision tower, aligner or language model) where the engines
    hold them already: a frozen weight is synced once, and again only after a sleep discarded it. LoRA merges
    adapters into frozen base weights, so a LoRA model sends every weight."""
    state: dict[str, torch.Tensor] = dict(model.state_dict())
    if not holds_frozen or any(name.startswith(_PEFT_PREFIX) for name in state):
        return state
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {name: tensor for name, tensor in state.items() if name not in frozen}


def module_of(name: str) -> str:
    """The module a weight belongs to, with PEFT's LoRA parts folded in (they must travel together)."""
    match = _LORA.match(name)
    if match:
        return match["module"]
    return name.rsplit(".", 1)[0].replace(".base_layer", "")


def plan_buckets(sizes: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
    """Names in order, packed into buckets of at most ``bucket_bytes`` without splitting a module
    (a module larger than the bucket travels alone)."""
    groups: dict[str, list[str]] = {}
    for name in sizes:
        groups.setdefault(module_of(name), []).append(name)
    buckets: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for names in groups.values():
        size = sum(sizes[n] for n in names)
        if current and filled + size > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.extend(names)
        filled += size
    if current:
        buckets.append(current)
    return buckets


Wire = tuple[Any, str, tuple[int, ...]]
"""A tensor on its way through the object store: its bytes as a numpy uint8 array, dtype, shape."""


def to_wire(bucket: dict[str, torch.Tensor]) -> dict[str, Wire]:
    """Tensors as numpy byte arrays: Ray stores numpy buffers as they are and readers map them without a
    copy (pickled torch tensors are copied on both sides); bytes also carry dtypes numpy lacks (bf16)."""
    out: dict[str, Wire] = {}
    for name, tensor in bucket.items():
        flat = tensor.detach().contiguous().view(-1)
        out[name] = (flat.view(torch.uint8).numpy(), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
    return out


def from_wire(bucket: dict[str, Wire]) -> dict[str, torch.Tensor]:
    """Read-only tensors over the object store's memory (the engines copy from them)."""
    import warnings

    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, (data, dtype, shape) in bucket.items():
            if data.size == 0:  # an empty shard (FSDP gives the last ranks nothing when rows run out)
                out[name] = torch.empty(shape, dtype=getattr(torch, dtype))
                continue
            out[name] = torch.from_numpy(data).view(getattr(torch, dtype)).view(shape)
    return out


class AliveBytes:
    """Bytes of tracked tensors not yet garbage collected, and the peak since :meth:`reset`."""

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.peak = self.alive

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            with self._lock:
                self.alive += size
                self.peak = max(self.peak, self.alive)
            weakref.finalize(tensor, self._release, size)

    def _release(self, size: int) -> None:
        with self._lock:
            self.alive -= size


def shard_layout(state: dict[str, torch.Tensor], rank: int) -> tuple[bool, int, int]:
    """(sends, part, parts) for this rank: whether its local shards are needed (one replica of each shard
    is), which dim-0 part of every sharded tensor it holds, and how many parts there are."""
    from torch.distributed.tensor import DTensor

    for tensor in state.values():
        if isinstance(tensor, DTensor):
            mesh, coords = tensor.device_mesh, tensor.device_mesh.get_coordinate()
            assert coords is not None, "this rank is not in the model's device mesh"
            sends, part, parts = True, 0, 1
            for dim, placement in enumerate(tensor.placements):
                if placement.is_shard():
                    if getattr(placement, "dim", 0) != 0:
                        raise ValueError(f"weight sync expects FSDP's dim-0 shards, got {tensor.placements}")
                    part, parts = coords[dim], mesh.size(dim)
                elif coords[dim] != 0:
                    sends = False  # a replica (HSDP): the replica with coordinate 0 sends
            return sends, part, parts
    return rank == 0, 0, 1


def local_part(state: dict[str, torch.Tensor], names: list[str], part: int) -> dict[str, torch.Tensor]:
    """This rank's piece of a bucket on CPU: its shard of every sharded tensor (possibly empty), and the
    unsharded tensors when it holds part 0."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name in names:
        tensor = state[name].detach()
        if isinstance(tensor, DTensor):
            out[name] = tensor.to_local().cpu()
        elif part == 0:
            out[name] = tensor.cpu()
    return out


def join_parts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from the parts of a bucket (part 0 names every tensor; shards join along dim 0)."""
    out = {}
    for name in parts[0]:
        pieces = [p[name] for p in parts if name in p]
        out[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out


def push_weights(model: torch.nn.Module, rank: int, targets: list[Any], bucket_bytes: int,
                 lora_scale: float, holds_frozen: bool) -> dict[str, float]:
    """Stream ``model``'s weights to the rollout workers ``targets`` (Ray actor handles), bucket by bucket.

    Every actor rank calls this. Each rank that holds a needed shard puts its part of the bucket in the
    object store and hands the reference to every target; a target assembles the full tensors once all
    parts of a bucket are in and loads them. A rank moves to bucket k+1 only after bucket k-1 is loaded
    (the ranks agree after each bucket), so at most two buckets wait in the object store; vLLM itself may
    hold a layer's earlier tensors until the rest of the layer arrives.
    """
    import ray
    import torch.distributed as dist

    start = time.perf_counter()
    state = weights_to_send(model, holds_frozen)  # (every rank decides alike: the actor's own record)
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}  # a DTensor's numel is global
    buckets = plan_buckets(sizes, bucket_bytes)
    sends, part, parts = shard_layout(state, rank)
    grouped = dist.is_initialized() and dist.get_world_size() > 1

    def in_step(calls: list[Any]) -> None:
        """Wait for ``calls``, then for every rank (the barrier); a failure anywhere fails every rank
        at once rather than leaving the others in a barrier until the process-group timeout."""
        error: Optional[BaseException] = None
        try:
            ray.get(calls)
        except Exception as err:  # noqa: BLE001 - re-raised below, after the ranks agree
            error = err
        failed = torch.tensor([0 if error is None else 1])
        if grouped:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if int(failed):
            raise RuntimeError("weight sync failed on another actor rank (its error names the cause)")

    partial = len(state) < len(model.state_dict())
    in_step([t.begin_weight_update.remote(lora_scale, partial) for t in targets] if rank == 0 else [])
    times = {"put": 0.0, "wait": 0.0}
    previous: list[Any] = []
    for index, names in enumerate(buckets):
        current: list[Any] = []
        if sends:
            mark = time.perf_counter()
            ref = ray.put(to_wire(local_part(state, names, part)))
            times["put"] += time.perf_counter() - mark
            current = [t.receive_part.remote(index, part, parts, ref) for t in targets]
            del ref
        mark = time.perf_counter()
        in_step(previous)  # every rank's bucket k-1 is loaded: at most two buckets in the object store
        times["wait"] += time.perf_counter() - mark
        previous = current
    in_step(previous)
    out = {"sync/buckets": float(len(buckets)), "sync/model_mb": sum(sizes.values()) / 2**20,
           **{f"sync/{k}_s": v for k, v in times.items()}}
    if rank == 0:
        done = ray.get([t.finish_weight_update.remote() for t in targets])
        out["sync/tensors"] = float(min(d["loaded"] for d in done))
        out["sync/assembled_peak_mb"] = max(d["assembled_peak_mb"] for d in done)
    out["sync/seconds"] = time.perf_counter() - start
    return out


def full_bucket(state: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor]:
    """The full tensors of one bucket on ``device`` in ``dtype``, every rank calling in the same order. FSDP's
    shards (row chunks on one mesh dimension) are cast first (half the traffic for bf16 engines) and travel in
    one all-gather per group of small ones (:data:`GATHER_GROUP_BYTES`) or per large one
    (:func:`gather_row_shards`); a tensor placed any other way is gathered alone (DTensor's ``full_tensor``)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    by_mesh: dict[tuple[Any, int], dict[str, tuple[torch.Tensor, torch.Size]]] = {}
    for name in names:
        tensor = state[name].detach()
        if not isinstance(tensor, DTensor):
            out[name] = tensor.to(device, dtype) if tensor.is_floating_point() else tensor.to(device)
            continue
        local = tensor.to_local()
        if local.device != device:  # CPU-offloaded shards gather where the engine computes
            local = local.to(device, non_blocking=True)
        if local.is_floating_point():
            local = local.to(dtype)
        mesh_dim = row_shard_dim(tensor)
        if mesh_dim is None:
            out[name] = DTensor.from_local(local, tensor.device_mesh, tensor.placements, shape=tensor.shape,
                                           stride=tensor.stride()).full_tensor()
        else:
            by_mesh.setdefault((tensor.device_mesh, mesh_dim), {})[name] = (local, tensor.shape)
    for (mesh, mesh_dim), shards in by_mesh.items():
        for group in coalesced(shards, mesh.size(mesh_dim), GATHER_GROUP_BYTES):
            out.update(gather_row_shards(group, mesh.get_group(mesh_dim), mesh.size(mesh_dim)))
    return {name: out[name] for name in names}


GATHER_GROUP_BYTES = 4 * 2**20
"""Row shards travel together up to this many bytes per rank: a collective's fixed cost dominates small tensors
(a tiny model's 57 tensors: 74 -> 8 ms on two gloo ranks), while a large tensor gathered alone needs no packing
copy (its gathered block is already the full tensor)."""


def coalesced(shards: Mapping[str, tuple[torch.Tensor, torch.Size]], ranks: int,
              limit: int) -> list[dict[str, tuple[torch.Tensor, torch.Size]]]:
    """``shards`` in order, in groups of at most ``limit`` bytes of padded chunk (a larger one alone): sized by
    the full chunk, not the local one, so that every rank forms the same groups."""
    groups: list[dict[str, tuple[torch.Tensor, torch.Size]]] = []
    filled = limit
    for name, (local, shape) in shards.items():
        size = chunk_numel(shape, ranks) * local.element_size()
        if filled + size > limit:
            groups.append({})
            filled = 0
        groups[-1][name] = (local, shape)
        filled += size
    return groups


def chunk_numel(shape: torch.Size, ranks: int) -> int:
    """Elements of one rank's full row chunk of a tensor of ``shape`` (``torch.chunk``: ceil(rows / ranks) rows)."""
    return -(-shape[0] // ranks) * (shape[1:].numel() if len(shape) > 1 else 1)


def row_shard_dim(tensor: Any) -> Optional[int]:
    """The mesh dimension a DTensor is split over by rows (``Shard(0)``, replicated on every other dimension:
    FSDP's and HSDP's layout), or None for any other placement."""
    from torch.distributed.tensor import Replicate, Shard

    sharded = [i for i, p in enumerate(tensor.placements) if isinstance(p, Shard) and p.dim == 0]
    rest_replicated = all(isinstance(p, Replicate) for i, p in enumerate(tensor.placements) if i not in sharded)
    return sharded[0] if len(sharded) == 1 and rest_replicated else None


def gather_row_shards(shards: Mapping[str, tuple[torch.Tensor, torch.Size]], group: Any,
                      ranks: int) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's row chunks (``torch.chunk`` over ``ranks``: ceil(rows / ranks) rows each,
    trailing ranks short or empty), in one collective (``all_gather_single``): each rank sends its chunks padded to the
    full chunk size, back to back, and each tensor is read from the gathered block as its ranks' chunks in
    order."""
    import torch.distributed as dist

    slots, pieces = [], []
    for local, shape in shards.values():
        chunk_rows, slot = -(-shape[0] // ranks), chunk_numel(shape, ranks)
        flat = local.reshape(-1)
        pieces.append(torch.nn.functional.pad(flat, (0, slot - flat.numel())) if flat.numel() < slot else flat)
        slots.append((chunk_rows, slot))
    send = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    gathered = send.new_empty(ranks * send.numel())
    # torch 2.13 renamed all_gather_into_tensor (deprecated there, with a warning per call); 2.11 has only it
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(gathered, send, group=group)
    blocks = gathered.view(ranks, send.numel())
    out, offset = {}, 0
    for (name, (_, shape)), (chunk_rows, slot) in zip(shards.items(), slots):
        rows = blocks[:, offset:offset + slot].reshape(ranks * chunk_rows, *shape[1:])
        out[name] = rows[:shape[0]]
        offset += slot
    return out


def unsplit(state: Mapping[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
    """The full tensors of a state that is not split across processes (plain tensors, or DTensors on a one-rank
    mesh: one GPU), without a collective; None where some tensor is sharded over several ranks."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if isinstance(tensor, DTensor):
            if tensor.device_mesh.size() != 1:
                return None
            tensor = tensor.to_local()
        out[name] = tensor.detach()
    return out


def copy_grouped(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every (dst, src), cast on the way, as one multi-tensor copy per (devices, dtypes)
    group: a few kernel launches for the whole model rather than one per tensor."""
    groups: dict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in pairs:
        groups.setdefault((dst.device, src.device, dst.dtype, src.dtype), []).append((dst, src))
    for (dst_device, src_device, _, _), group in groups.items():
        dsts, srcs = [d for d, _ in group], [s for _, s in group]
        if dst_device == src_device:
            torch._foreach_copy_(dsts, srcs)
        else:  # offloaded master weights: one copy each, non-blocking from pinned host memory
            for dst, src in group:
                dst.copy_(src, non_blocking=True)


def _sync_unsplit(full: dict[str, torch.Tensor], engine: Any, lora_scale: float, dtype: torch.dtype,
                  start: float, partial: bool) -> dict[str, float]:
    """One process holds the whole actor (one GPU): the engine's weights are overwritten where they lie, the
    whole model in a few multi-tensor copies (cast to the engine's dtype on the way); what the engine does not
    take in place (renamed or fused weights: vLLM) goes through its ``load_weights`` once."""
    mark = time.perf_counter()
    engine.begin_weight_update(partial)
    targets = {name: target for name, target in engine.in_place_targets(list(full)).items()
               if target.dtype == dtype and target.shape == full[name].shape}
    copy_grouped([(target, full[name]) for name, target in targets.items()])
    rest = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
            for name, tensor in full.items() if name not in targets}
    loaded = engine.load_weights(to_hf_names(rest, lora_scale).items()) if rest else 0
    if getattr(engine, "device", torch.device("cpu")).type == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - mark
    engine.finish_weight_update()
    model_bytes = sum(t.numel() for t in full.values()) * torch.empty((), dtype=dtype).element_size()
    return {"sync/buckets": 1.0, "sync/model_mb": model_bytes / 2**20, "sync/tensors": float(loaded + len(targets)),
            "sync/in_place": float(len(targets)), "sync/gather_s": 0.0,
            "sync/load_s": load_s, "sync/seconds": time.perf_counter() - start}


def sync_in_process(model: torch.nn.Module, engine: Any, bucket_bytes: int, lora_scale: float,
                    dtype: torch.dtype) -> dict[str, float]:
    """The fused workers' sync: every rank gathers each bucket's full tensors (in the engine's dtype, on its
    device) and loads them into its own engine, in the same process: no object store, no host round trip
    where the weights live on the device (the process group's all-gather: NCCL on GPU, gloo on CPU). LoRA
    adapters are merged into their base weights (a module never splits across buckets). At most one bucket of
    full tensors is alive beyond the engine's own weights."""
    start = time.perf_counter()
    device = getattr(engine, "device", None) or torch.device("cpu")
    state = weights_to_send(model, engine.holds_frozen)  # (every rank's engine sleeps and syncs alike)
    partial = len(state) < len(model.state_dict())
    merged = any(name.startswith(_PEFT_PREFIX) for name in state)  # LoRA: names and values change on the way
    full = None if merged else unsplit(state)
    if full is not None:
        return _sync_unsplit(full, engine, lora_scale, dtype, start, partial)
    sizes = {name: t.numel() * torch.empty((), dtype=dtype).element_size() for name, t in state.items()}
    buckets = plan_buckets(sizes, bucket_bytes)
    times = {"gather": 0.0, "load": 0.0}
    engine.begin_weight_update(partial)
    loaded = 0
    for names in buckets:
        mark = time.perf_counter()
        bucket = full_bucket(state, names, dtype, device)
        times["gather"] += time.perf_counter() - mark
        mark = time.perf_counter()
        loaded += engine.load_weights(to_hf_names(bucket, lora_scale).items())
        times["load"] += time.perf_counter() - mark
        del bucket
    engine.finish_weight_update()
    return {"sync/buckets": float(len(buckets)), "sync/model_mb": sum(sizes.values()) / 2**20,
            "sync/tensors": float(loaded), "sync/in_place": 0.0,
            **{f"sync/{k}_s": v for k, v in times.items()}, "sync/seconds": time.perf_counter() - start}


class WeightTransport(abc.ABC):
    @abc.abstractmethod
    def sync(self, actor: WorkerGroup, rollout: WorkerGroup) -> dict[str, float]:
        """Push the actor's current weights to every rollout rank; returns sync metrics."""


class InProcessTransport(WeightTransport):
    """Fused workers: each process gathers the actor's weights and loads its own engine
    (:func:`sync_in_process`); the driver makes one call to the fused group."""

    def __init__(self, fused: WorkerGroup, bucket_mb: float) -> None:
        self.fused, self.bucket_bytes = fused, max(1, int(bucket_mb * 2**20))

    def sync(self, actor: WorkerGroup, rollout: WorkerGroup) -> dict[str, float]:
        results = self.fused.call("sync_weights", self.bucket_bytes)
        out = dict(results[0])
        out["sync/seconds"] = max(r["sync/seconds"] for r in results)
        return out


class BucketedTransport(WeightTransport):
    """The cross-process path: the actor streams buckets through Ray's object store to the rollout ranks."""

    def __init__(self, bucket_mb: float) -> None:
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))

    def sync(self, actor: WorkerGroup, rollout: WorkerGroup) -> dict[str, float]:
        if rollout.workers is actor.workers:  # a process cannot wait on a call to itself
            raise ValueError("actor and rollout share their processes (fused workers): use InProcessTransport")
        return actor.call("push_weights", rollout.workers, self.bucket_bytes)
