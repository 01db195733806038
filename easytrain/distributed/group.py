"""Worker groups: one Ray actor per rank of a role, called once per phase.

A worker class declares how each remote method is dispatched with
:func:`dispatch`: ``BROADCAST`` sends the same arguments to every rank and
returns every result; ``SCATTER`` splits a :class:`Batch` by data-parallel
rank (padding it to a multiple of the ranks first, and dropping the padding
from the gathered result) and concatenates the ranks' result batches;
``RANK0`` calls every rank (collectives need all of them) and returns rank
0's result; ``EACH`` takes a list with one first argument per data-parallel
member (work the driver has already planned, e.g. token-balanced micro
batches) and returns each member's result. A member is a block of
``block_size`` ranks that take the same input (a Ulysses sequence-parallel
group, a tensor-parallel engine); the block leader's result stands for it.
One remote call per rank per phase; tensors travel through Ray's object
store.

A group can host several roles in each process (fused workers: one process
per device holding the actor, the reference and the rollout engine). Each
role then gets a view (:meth:`WorkerGroup.view`): a group with the role's
name and block size that addresses the same processes, whose class has one
remote method per operation of each role it hosts.

Workers are created with ``max_restarts=0`` on purpose: a restarted rank
would come back without its shard of the model and optimizer and hang the
others' collectives, so a death is reported (role, rank, node) at once, even
while other ranks still wait in a collective; the driver then tears the
groups down and resumes from the latest checkpoint (``trainer.max_failures``)
or stops with the command to resume.
"""

from __future__ import annotations

import copy
import enum
import functools
import socket
import time
from typing import Any, Callable, Optional, TypeVar

import ray

from easytrain.config.errors import ConfigError
from easytrain.distributed.batch import Batch
from easytrain.distributed.resources import ResourcePool
from easytrain.memory import peaks
from easytrain.memory.flag import MemoryStop


F = TypeVar("F", bound=Callable[..., Any])
DISPATCH_ATTR = "__easytrain_dispatch__"


class Dispatch(enum.Enum):
    BROADCAST = "broadcast"
    SCATTER = "scatter"
    RANK0 = "rank0"
    EACH = "each"


BUSY: dict[str, float] = {}
"""Seconds this process spent inside each outermost dispatched call (by method name) since the last
:func:`busy_times` (a fused worker's ``update`` counts once, not again for its actor's)."""


def busy_times(reset: bool = True) -> dict[str, float]:
    """A copy of :data:`BUSY`, emptied when ``reset``."""
    out = dict(BUSY)
    if reset:
        BUSY.clear()
    return out


def dispatch(mode: Dispatch) -> Callable[[F], F]:
    """Declare how a worker method is called across the group; the process's busy time is recorded
    per method (:data:`BUSY`) so orchestration overhead can be told apart from work, and so are its host and
    device memory peaks (:mod:`easytrain.memory.peaks`), which the plan check compares with the plan. The
    outermost call trims the heap (:func:`easytrain.memory.peaks.trim_heap`) when it ends and before it starts:
    Ray drops a call's arguments and result only after the call returns, so what they held is freed after the
    first trim and would stay resident through the next call without the second."""
    def mark(fn: F) -> F:
        @functools.wraps(fn)
        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            start, outermost = time.perf_counter(), not peaks.active()
            if outermost:  # the last call's arguments and result, freed since its trim, go back first
                peaks.trim_heap()
            peaks.enter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                peaks.leave(fn.__name__)
                if outermost:  # its freed heap goes back before the next call; its time is the process's
                    peaks.trim_heap()
                    BUSY[fn.__name__] = BUSY.get(fn.__name__, 0.0) + time.perf_counter() - start
        setattr(timed, DISPATCH_ATTR, mode)
        return timed  # type: ignore[return-value]
    return mark


class WorkerError(RuntimeError):
    """A worker died or raised; the message names role, rank and node."""


class WorkerDied(WorkerError):
    """A worker's process is gone (killed, out of memory, node lost)."""

    def __init__(self, role: str, rank: int, node_ip: str, message: str) -> None:
        super().__init__(message)
        self.role, self.rank, self.node_ip = role, rank, node_ip


def is_dead(actor: Any) -> bool:
    """Whether Ray's actor table says ``actor`` is dead (read from the GCS: the public state API needs the
    dashboard, which may be off; an unreadable entry is not taken as proof of death)."""
    from ray._private import state

    try:
        info = state.actors(actor_id=actor._actor_id.hex())  # noqa: SLF001
    except Exception:  # noqa: BLE001
        return False
    return isinstance(info, dict) and info.get("State") == "DEAD"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class WorkerGroup:
    def __init__(self, worker_cls: type, role: str, pool: ResourcePool, *, num_cpus: float, num_gpus: float,
                 init_args: tuple[Any, ...] = (), env: Optional[dict[str, str]] = None, block_size: int = 1) -> None:
        """``block_size`` consecutive ranks act as one data-parallel member (a tensor-parallel vLLM engine):
        SCATTER gives each rank of a block the same chunk and keeps the block leader's result."""
        self.role, self.pool, self.worker_cls = role, pool, worker_cls
        if pool.world_size % block_size:
            raise ValueError(f"{role}: blocks of {block_size} ranks do not tile {pool.world_size} workers")
        self.block_size = block_size
        remote_cls = ray.remote(worker_cls)
        self.workers: list[Any] = []
        for placement in pool.placements:
            options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0,
                           scheduling_strategy=pool.strategy(placement.rank),
                           name=f"easytrain-{role}-{placement.rank}-{id(self):x}",
                           runtime_env={"env_vars": dict(env or {})})
            self.workers.append(remote_cls.options(**options).remote(
                *init_args, role=role, rank=placement.rank, world_size=pool.world_size))

    def view(self, role: str, block_size: int = 1) -> "WorkerGroup":
        """The same processes addressed as ``role``'s group (the roles of a fused worker): calls go to this
        group's own remote methods, under the role's name and with its block size."""
        if self.world_size % block_size:
            raise ValueError(f"{role}: blocks of {block_size} ranks do not tile {self.world_size} workers")
        view = copy.copy(self)
        view.role, view.block_size = role, block_size
        return view

    def _method(self, worker: Any, method: str) -> Any:
        return getattr(worker, method).remote

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def members(self) -> int:
        """Data-parallel members: blocks of ``block_size`` ranks (a Ulysses group, a tensor-parallel engine)."""
        return self.world_size // self.block_size

    def init_process_group(self) -> None:
        """One torch.distributed world for the role (``cpu:gloo,cuda:nccl``), rendezvous at rank 0."""
        address = self._get([self.workers[0].node_ip.remote()], "node_ip")[0]
        port = self._get([self.workers[0].open_store.remote()], "open_store")[0]
        self._get([w.init_process_group.remote(address, port) for w in self.workers], "init_process_group")

    def _rendezvous(self, rank: int) -> tuple[str, int]:
        """Address and a free port on ``rank``'s node, for a process group that meets there."""
        address = self._get([self.workers[rank].node_ip.remote()], "node_ip")[0]
        port = self._get([self.workers[rank].free_port.remote()], "free_port")[0]
        return address, port

    def init_blocks(self) -> None:
        """Each block of ``block_size`` ranks rendezvouses at its leader: the torch.distributed environment
        (RANK within the block, WORLD_SIZE, MASTER_ADDR/PORT) that vLLM's external launcher reads."""
        b = self.block_size
        for leader in range(0, self.world_size, b):
            address, port = self._rendezvous(leader)
            self._get([self._method(self.workers[leader + i], "set_block_env")(address, port, i, b) for i in range(b)],
                      "set_block_env")

    def _mode(self, method: str) -> Dispatch:
        fn = getattr(self.worker_cls, method, None)
        if fn is None:
            raise AttributeError(f"{self.worker_cls.__name__} has no method {method!r}")
        return getattr(fn, DISPATCH_ATTR, Dispatch.BROADCAST)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the group with its declared dispatch and wait for the result."""
        return self.collect(self.submit(method, *args, **kwargs))

    def submit(self, method: str, *args: Any, **kwargs: Any) -> "Pending":
        """Start ``method`` on every rank without waiting (see :meth:`collect`)."""
        mode = self._mode(method)
        if mode is Dispatch.EACH:
            shares, rest = args[0], args[1:]
            if len(shares) != self.members:
                raise ValueError(f"{self.role}.{method} takes one share per data-parallel member: {len(shares)} "
                                 f"for {self.members} ({self.world_size} ranks in blocks of {self.block_size})")
            return Pending(method, mode, [self._method(w, method)(shares[rank // self.block_size], *rest, **kwargs)
                                          for rank, w in enumerate(self.workers)], block_size=self.block_size)
        if mode is not Dispatch.SCATTER:
            refs = [self._method(w, method)(*args, **kwargs) for w in self.workers]
            return Pending(method, mode, refs)
        batch, rest = args[0], args[1:]
        if not isinstance(batch, Batch):
            raise TypeError(f"{self.role}.{method} scatters a Batch, got {type(batch).__name__}")
        n, members = len(batch), self.members
        pad = (-n) % members
        if pad:  # repeat leading samples; their results are dropped in collect
            batch = batch.select(list(range(n)) + [i % n for i in range(pad)])
        chunks = batch.split(members)
        refs = [self._method(w, method)(chunks[rank // self.block_size], *rest, **kwargs)
                for rank, w in enumerate(self.workers)]
        real, start = [], 0
        for chunk in chunks:  # how many samples of each chunk are real (padding sits at the end)
            real.append(max(0, min(len(chunk), n - start)))
            start += len(chunk)
        return Pending(method, mode, refs, [len(c) for c in chunks], real, self.block_size)

    def collect(self, pending: "Pending") -> Any:
        results = self._get(pending.refs, pending.method)
        if pending.mode is Dispatch.RANK0:
            return results[0]
        if pending.mode in (Dispatch.SCATTER, Dispatch.EACH):
            results = results[::pending.block_size]  # one result per block: its leader's
        if pending.mode is Dispatch.SCATTER and all(isinstance(r, Batch) for r in results):
            kept = []
            for result, size, real in zip(results, pending.chunk_sizes, pending.real_sizes):
                per_sample = len(result) // size if size else 0  # e.g. n responses per prompt
                kept.append(result if real == size else result.select(range(real * per_sample)))
            return Batch.concat(kept)
        return results

    def _get(self, refs: list[Any], method: str) -> list[Any]:
        """Results in rank order; the first rank to fail raises at once, even while others still run
        (a rank blocked in a collective with a dead peer would otherwise hang the driver)."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            for ref in ready:
                results[rank_of[ref]] = self._result(ref, rank_of[ref], method)
        return [results[rank] for rank in range(len(refs))]

    def _result(self, ref: Any, rank: int, method: str) -> Any:
        place = self.pool.placements[rank]
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise WorkerDied(self.role, rank, place.node_ip,
                             f"{self.role} worker rank {rank} on node {place.node_ip} died during {method}: "
                             f"{reason}") from err
        except ray.exceptions.RayTaskError as err:
            cause = err.cause if getattr(err, "cause", None) is not None else err
            if isinstance(cause, MemoryStop):  # the worker saw hard memory pressure and stopped: the step ends
                raise cause from None
            if isinstance(cause, ConfigError):  # a config value the worker could not use (model.path): one line
                raise cause from None
            raise WorkerError(f"{self.role} worker rank {rank} on node {place.node_ip} failed in {method}: "
                              f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
                              ) from err

    def dead_ranks(self) -> list[tuple[int, str]]:
        """(rank, node IP) of the workers Ray reports dead (read from Ray's actor table)."""
        return [(rank, self.pool.placements[rank].node_ip) for rank, worker in enumerate(self.workers)
                if is_dead(worker)]

    def shutdown(self) -> None:
        """Kill the group's processes (a view's are its host's: killing them twice is harmless)."""
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


class Pending:
    """Calls started on every rank of a group, not yet collected."""

    def __init__(self, method: str, mode: Dispatch, refs: list[Any], chunk_sizes: Optional[list[int]] = None,
                 real_sizes: Optional[list[int]] = None, block_size: int = 1) -> None:
        self.method, self.mode, self.refs, self.block_size = method, mode, refs, block_size
        self.chunk_sizes, self.real_sizes = chunk_sizes or [], real_sizes or []
