"""Moving the actor's weights into the rollout engines, in place, in buckets, without disk.

The actor's ranks gather their FSDP shards one bucket at a time (every rank
takes part in each all-gather); rank 0 renames the bucket to HF names (PEFT
prefixes stripped, LoRA merged), puts it in Ray's object store and has every
rollout rank load it, while the ranks gather the next one. So at most one
gathered bucket is alive in an actor process and at most two in the object
store, whatever the model's size: the extra memory a sync takes is bounded by
``worker.rollout.sync_bucket_mb``, not by the model. The driver makes one
call; the buckets flow from the actor to the rollout workers directly.

:class:`AliveBytes` measures that bound: it counts the bytes of gathered
tensors still alive (released by the garbage collector, not by bookkeeping)
and their peak.
"""

from __future__ import annotations

import abc
import re
import threading
import time
import weakref
from typing import Any, Iterable, Mapping

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


def push_weights(model: torch.nn.Module, rank: int, targets: list[Any], bucket_bytes: int,
                 lora_scale: float, meter: AliveBytes) -> dict[str, float]:
    """Stream ``model``'s full weights to the rollout workers ``targets`` (Ray actor handles), bucket by
    bucket. Every actor rank calls this (the gathers are collectives); only rank 0 sends."""
    import ray
    from torch.distributed.tensor import DTensor

    start = time.perf_counter()
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if id(tensor) not in seen:  # tied weights are sent once (under their first name)
            seen.add(id(tensor))
            state[name] = tensor
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    buckets = plan_buckets(sizes, bucket_bytes)
    meter.reset()
    if rank == 0:
        ray.get([t.begin_weight_update.remote() for t in targets])
    in_flight: list[Any] = []
    loaded = 0
    for names in buckets:
        full: dict[str, torch.Tensor] = {}
        for name in names:
            local = state[name].detach()
            gathered = local.full_tensor() if isinstance(local, DTensor) else local
            gathered = gathered.cpu()
            if gathered is not local:
                meter.track([gathered])
            full[name] = gathered
        if rank == 0:
            ref = ray.put(to_hf_names(full, lora_scale))
            del full
            loaded += sum(ray.get(in_flight))  # the previous bucket is in: at most two in the object store
            in_flight = [t.load_weight_bucket.remote(ref) for t in targets]
            del ref
        else:
            del full
    received = [0.0]
    if rank == 0:
        loaded += sum(ray.get(in_flight))
        received = [r["received_peak_mb"] for r in ray.get([t.finish_weight_update.remote() for t in targets])]
    seconds = time.perf_counter() - start
    total = sum(sizes.values())  # a DTensor's numel is the full tensor's
    return {"sync/tensors": float(loaded / max(1, len(targets))), "sync/buckets": float(len(buckets)),
            "sync/gathered_peak_mb": meter.peak / 2**20, "sync/received_peak_mb": max(received),
            "sync/model_mb": total / 2**20, "sync/seconds": seconds}


class WeightTransport(abc.ABC):
    @abc.abstractmethod
    def sync(self, actor: WorkerGroup, rollout: WorkerGroup) -> dict[str, float]:
        """Push the actor's current weights to every rollout rank; returns sync metrics."""


class BucketedTransport(WeightTransport):
    """The cross-process path: the actor streams buckets through Ray's object store to the rollout ranks."""

    def __init__(self, bucket_mb: float) -> None:
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))

    def sync(self, actor: WorkerGroup, rollout: WorkerGroup) -> dict[str, float]:
        return actor.call("push_weights", rollout.workers, self.bucket_bytes)
