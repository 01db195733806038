"""Gathering FSDP shards among the processes of one node on CPU through shared memory.

On a GPU the fused workers' weight sync all-gathers each bucket over NCCL. On CPU the process group is gloo,
whose all-gather goes through TCP sockets even between processes of one machine: ~0.7 GB/s here, a tenth of
one core's memory copy. Processes of one node instead share a staging buffer each, in ``/dev/shm``: per bucket
every rank copies its local shards into its own buffer, the ranks meet, and each copies every rank's shards
out of the buffers straight into the full tensors (or into the engine's own weights, when it takes them in
place), then they meet again before the next bucket overwrites the buffers. Two plain memory copies per byte
and two barriers per bucket.

The buffers are mapped by every rank and unlinked at once, so nothing is left in ``/dev/shm`` when a worker
dies; their memory returns when the last process unmaps them. Each is as large as its rank's share of the
largest bucket. Used when every rank of the world runs on this host (else the process group all-gathers).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SHM = "/dev/shm"
MARK = 16
"""Bytes at the head of each buffer holding its rank's random mark (checked by the others after mapping)."""


class NodeStaging:
    """One shared staging buffer per rank of the world, every rank mapping all of them."""

    def __init__(self, buffers: list[torch.Tensor], rank: int) -> None:
        self.buffers, self.rank = buffers, rank

    @property
    def capacity(self) -> int:
        """Bytes of shards a bucket may stage per rank."""
        return int(self.buffers[self.rank].numel()) - MARK

    @classmethod
    def connect(cls, need: int) -> Optional["NodeStaging"]:
        """Every rank calls this (collectives) with its largest per-bucket share in bytes: the buffers when all
        ranks share this host's ``/dev/shm`` (each finds the others' marks in their buffers), else None on every
        rank. Each buffer is allocated in full up front, so a ``/dev/shm`` too small for it (64 MB in a default
        container) falls back here instead of failing mid-sync."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        rank, world = dist.get_rank(), dist.get_world_size()
        token = [uuid.uuid4().hex if rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        path = os.path.join(SHM, f"easytrain-sync-{token[0]}-{rank}")
        size = MARK + max(1, need)
        mark = torch.tensor(list(uuid.uuid4().bytes), dtype=torch.uint8)
        made: Optional[torch.Tensor] = None
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(descriptor, 0, size)  # ENOSPC now, not SIGBUS at the first copy
            finally:
                os.close(descriptor)
            made = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            made[:MARK].copy_(mark)
        except Exception as err:  # noqa: BLE001 - any failure here means: gather through the process group
            logger.info("weight sync: no shared staging buffer in %s (%s); gathering through the process group",
                        SHM, err)
        peers: list[Any] = [None] * world
        mine = (socket.gethostname(), path if made is not None else None, size, mark.tolist())
        dist.all_gather_object(peers, mine)
        usable = len({host for host, _, _, _ in peers}) == 1 and all(p is not None for _, p, _, _ in peers)
        buffers: list[torch.Tensor] = []
        if usable:
            try:
                for r, (_, peer_path, peer_size, peer_mark) in enumerate(peers):
                    if r == rank:
                        buffers.append(made)  # type: ignore[arg-type]
                        continue
                    if not os.path.exists(peer_path):  # another /dev/shm (a container without the host's IPC)
                        raise FileNotFoundError(peer_path)
                    mapped = torch.from_file(peer_path, shared=True, size=peer_size, dtype=torch.uint8)
                    if mapped[:MARK].tolist() != peer_mark:
                        raise RuntimeError(f"rank {r}'s staging buffer holds another mark")
                    buffers.append(mapped)
            except Exception as err:  # noqa: BLE001
                logger.info("weight sync: cannot share staging buffers with the other ranks (%s)", err)
                usable = False
        agreed = torch.tensor([1 if usable else 0])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # every rank has mapped every buffer (or given up)
        if made is not None:
            os.unlink(path)  # the mappings stay; nothing is left behind if a process dies
        return cls(buffers, rank) if int(agreed) else None

    def gather(self, state: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype,
               targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The full tensors of ``names`` in ``dtype``: into ``targets[name]`` where given (contiguous, the right
        shape and dtype), else into new tensors. FSDP's dim-0 shards are laid end to end in rank order."""
        from torch.distributed.tensor import DTensor

        mine = self.buffers[self.rank]
        sizes: list[int] = []
        offset = MARK
        for name in names:
            tensor = state[name].detach()
            if not isinstance(tensor, DTensor):
                sizes.append(-1)
                continue
            local = tensor.to_local().to(dtype).reshape(-1).view(torch.uint8)
            size = local.numel()
            if offset + size > mine.numel():
                raise RuntimeError(f"weight sync: staging buffer of {mine.numel()} bytes too small at {name}")
            mine[offset:offset + size].copy_(local)
            sizes.append(size)
            offset += size
        everyone: list[Any] = [None] * len(self.buffers)
        dist.all_gather_object(everyone, sizes)  # also the barrier: every rank's shards are staged
        starts = [MARK] * len(self.buffers)
        out: dict[str, torch.Tensor] = {}
        for i, name in enumerate(names):
            tensor = state[name].detach()
            if sizes[i] < 0:  # not sharded: every rank holds it whole
                out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
                if name in targets:
                    targets[name].copy_(out[name])
                continue
            full = targets.get(name)
            if full is None:
                full = torch.empty(tensor.shape, dtype=dtype)
            flat, at = full.view(-1).view(torch.uint8), 0
            for rank, shares in enumerate(everyone):
                size = shares[i]
                flat[at:at + size].copy_(self.buffers[rank][starts[rank]:starts[rank] + size])
                starts[rank] += size
                at += size
            if at != flat.numel():
                raise RuntimeError(f"weight sync: the shards of {name} hold {at} bytes, the tensor {flat.numel()}")
            out[name] = full
        dist.barrier()  # every rank has read every buffer: the next bucket may overwrite them
        return out
