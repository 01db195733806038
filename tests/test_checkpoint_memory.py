"""Checkpoint saves within a host-memory buffer (``trainer.checkpoint_host_buffer_gb``) and background saves
(``trainer.checkpoint_async``).

The memory test measures a real save in a fresh process: RSS before the save against the kernel's peak RSS
(VmHWM, reset first) while it runs. On a GPU every tensor of the state is copied to the host to be written; on
CPU only those whose storage holds more than the tensor (views into a flat buffer, FSDP2's padded shards, a
piece of a larger tensor) are. The model here keeps its parameters as views of one flat buffer, so they all
take the copy path a GPU's state takes, and its embedding (128 MiB) is larger than a piece.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.config import load
from easytrain.config import ConfigError
from easytrain.distributed.checkpoint import _boxes
from easytrain.memory.host import BUFFER_RANGE, host_buffer_bytes
from easytrain.distributed.group import WorkerError
from easytrain.trainer.checkpoint import LATEST, CheckpointWriter, latest
from easytrain.trainer.base import RunFailed

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

ALLOWANCE = 8 * MiB
"""What a save holds beyond its piece: the plan's and metadata's Python objects and the modules DCP imports at
its first save. A save with nothing to copy (tensors written from their own storage) measured 1-3 MiB here, and
the 0.05 GB save below 1.8 MiB above its 25.6 MiB piece; 8 MiB leaves room for allocator granularity (glibc
grows and trims its heap in 128 KiB+ steps) and is well under the piece it is added to."""

SAVER = r"""
import ctypes, gc, json, os, sys
from pathlib import Path
import torch, torch.distributed as dist

def resident_bytes(path):  # bytes of the file in the page cache (mincore); None on tmpfs, where that is the file
    mount = max((line.split() for line in Path("/proc/mounts").read_text().splitlines()),
                key=lambda m: len(m[1]) if str(path).startswith(m[1]) else -1)
    if mount[2] in ("tmpfs", "ramfs"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: maps without reading a page
        pages = (ctypes.c_ubyte * ((size + page - 1) // page))()
        try:
            assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), pages) == 0, ctypes.get_errno()
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in pages) * page

def vm(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(32768, 1024), *[torch.nn.Linear(1024, 1024) for _ in range(6)])
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # one buffer, the parameters views of it
    offset = 0
    for p in params:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return model, optimizer, scheduler

out, init_method, runs = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from easytrain.distributed.checkpoint import load_training_state, save_training_state

model, optimizer, scheduler = build(0)
model(torch.randint(0, 32768, (2, 8))).sum().backward()
optimizer.step()
optimizer.zero_grad(set_to_none=True)
state_bytes = 3 * 4 * sum(p.numel() for p in model.parameters())  # fp32 weights and two Adam moments
for i, run in enumerate(runs):
    folder = out / f"save{i}"
    gc.collect()
    before = vm("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    if run["writer"] == "dcp":  # DCP's own writer, for comparison
        model_sd, optim_sd = get_state_dict(model, optimizer)
        optim_sd.pop("param_groups")
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=FileSystemWriter(folder, sync_files=True))
        del model_sd, optim_sd
    else:
        save_training_state(folder, model, optimizer, scheduler, 0, buffer_bytes=int(run["buffer_gb"] * 2**30))
    peak = vm("VmHWM:")
    print(json.dumps({**run, "before": before, "peak": peak, "state": state_bytes,
                      "resident": resident_bytes(folder / "__0_0.distcp")}), flush=True)

fresh, fresh_optimizer, fresh_scheduler = build(1)
load_training_state(out / "save0", fresh, fresh_optimizer, fresh_scheduler, 0)
exact = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
for p, q in zip(model.parameters(), fresh.parameters()):
    saved, loaded = optimizer.state[p], fresh_optimizer.state[q]
    exact = exact and all(torch.equal(saved[k], loaded[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
print(json.dumps({"exact": exact}), flush=True)
"""


def run_saver(tmp_path: Path, runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    from rendezvous import rendezvous

    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), rendezvous(tmp_path), json.dumps(runs)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return lines[:-1], lines[-1]["exact"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's per-process peak RSS")
def test_a_save_holds_at_most_its_buffer_above_the_steps_host_memory(tmp_path: Path) -> None:
    small, large = 0.05, 0.2  # GB; the state is 456 MiB, 9x the small buffer
    # the larger buffer and DCP's writer run after the small one, in the same process: memory the earlier saves
    # freed can only lower their peaks, so the comparisons below stay conservative
    saves, exact = run_saver(tmp_path, [{"writer": "pieces", "buffer_gb": small},
                                        {"writer": "pieces", "buffer_gb": large}, {"writer": "dcp"}])
    peaks = {s.get("buffer_gb", "dcp"): s["peak"] - s["before"] for s in saves}
    state = saves[0]["state"]
    for buffer_gb in (small, large):
        buffer = buffer_gb * 2**30
        assert state >= 2 * buffer
        # RSS holds one piece (half the buffer) at a time; the other half is for written pages not yet dropped
        # from the page cache, which RSS does not count (checked below)
        assert peaks[buffer_gb] <= buffer / 2 + ALLOWANCE, (buffer_gb, peaks[buffer_gb] / MiB)
    assert peaks[small] < peaks[large] - 32 * MiB  # the key is honoured: pieces of 25.6 and 102 MiB
    assert peaks["dcp"] > small * 2**30, "DCP's own writer stayed within the buffer: this test shows nothing"
    assert exact  # a save in pieces loads back bit for bit: weights, Adam moments, steps
    if saves[0]["resident"] is not None:  # written pages were dropped from the page cache (a container's memory)
        assert saves[0]["resident"] <= small * 2**30 / 2, saves[0]["resident"] / MiB


def test_pieces_cover_each_tensor_once_within_the_limit() -> None:
    for shape, itemsize, limit in [((1000, 300), 4, 100_000), ((7, 5000, 3), 2, 9_000), ((10,), 4, 4),
                                   ((3, 100_000), 4, 1_000), ((64, 64), 4, 10**9), ((), 4, 1)]:
        seen = torch.zeros(shape, dtype=torch.int32)
        for offsets, sizes in _boxes([0] * len(shape), list(shape), itemsize, limit):
            assert math.prod(sizes) * itemsize <= max(limit, itemsize), (shape, sizes)
            index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            seen[index] += 1
        assert bool((seen == 1).all()), shape


def test_the_default_buffer_is_a_share_of_the_node() -> None:
    assert host_buffer_bytes(0.5, 10**12, 8) == 2**29  # set: taken as given
    assert host_buffer_bytes(-1, 2**41, 8) == BUFFER_RANGE[1]  # a 2 TiB node's 1/64 / 8: 4 GiB, 2 GiB at most
    assert host_buffer_bytes(-1, 2**37, 8) == BUFFER_RANGE[0]  # 128 GiB: 0.25 GiB
    assert host_buffer_bytes(-1, 2**36, 8) == BUFFER_RANGE[0]  # 64 GiB: 0.125 GiB, 0.25 GiB at least
    assert host_buffer_bytes(-1, 2**38, 8) == 2**29  # 256 GiB: 0.5 GiB


@pytest.mark.parametrize("value", [0, -0.5, -2])
def test_a_buffer_that_is_not_positive_is_refused_naming_the_key(value: float) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.checkpoint_host_buffer_gb"):
        load([f"trainer.checkpoint_host_buffer_gb={value}"])


def test_background_saves_need_fsdp() -> None:
    assert load(["trainer.checkpoint_async=true"]).trainer.checkpoint_async
    with pytest.raises(ConfigError, match=r"trainer\.checkpoint_async.*worker\.actor\.strategy=fsdp"):
        load(["+exp=tiny_sft", "trainer.checkpoint_async=true", "worker.actor.strategy=deepspeed"])


# ----------------------------------------------------------------------------- background saves


ASYNC_SAVER = r"""
import os, sys, torch, torch.distributed as dist
from pathlib import Path
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from easytrain.distributed.checkpoint import load_training_state, save_training_state

rank, world, init_method, out, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5]
dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)

def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(3001, 257), torch.nn.Linear(257, 1023), torch.nn.Linear(1023, 5))
    if world > 1:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 / (i + 1))

def step(model, optimizer, scheduler):
    torch.manual_seed(7)
    model(torch.randint(0, 3001, (4, 7))).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()

def full(model, optimizer):  # rank 0: every tensor, whole, cloned (the optimizer's steps are updated in place)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                    cpu_offload=True))
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for name, state in optim_sd.get("state", {}).items():
        flat.update({f"optim.{name}.{k}": v for k, v in state.items()})
    return {k: v.clone() for k, v in flat.items()}

model, optimizer, scheduler = build(0 if mode == "save" else 1)
if mode == "save":
    step(model, optimizer, scheduler)
    group = dist.new_group(backend="gloo")
    pending = save_training_state(out / "ckpt", model, optimizer, scheduler, rank, buffer_bytes=2**21,
                                  background=True, process_group=group)
    expected = full(model, optimizer)
    for _ in range(3):  # training goes on (collectives on the default group) while the thread writes
        step(model, optimizer, scheduler)
    report = pending.wait()
    assert report["write_s"] > 0 and report["staged_gb"] > 0, report
    now = full(model, optimizer)  # collective
    if rank == 0:
        torch.save(expected, out / "expected.pt")
        assert any(not torch.equal(v, expected[k]) for k, v in now.items())  # training moved on
else:
    info = load_training_state(out / "ckpt", model, optimizer, scheduler, rank)
    loaded = full(model, optimizer)
    if rank == 0:
        expected = torch.load(out / "expected.pt")
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[k], v) for k, v in expected.items()), [k for k, v in expected.items()
                                                                              if not torch.equal(loaded[k], v)]
        assert info["saved_ranks"] == 2 and scheduler.last_epoch == 1
dist.barrier()  # no rank leaves while another still talks to it; then the groups go down before the interpreter
dist.destroy_process_group()  # (gloo's threads torn down at exit instead once aborted the process: SIGABRT)
print("ok", rank, flush=True)
os._exit(0)  # no interpreter teardown: its static destructors (the store's and gloo's threads) aborted it once more
"""


def run_ranks(script: Path, world: int, *args: str) -> None:
    from rendezvous import rendezvous

    init_method = rendezvous(script.parent)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(world), init_method, *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"ok {rank}" in out, err[-3000:]


def test_a_background_save_is_the_state_when_it_was_taken_and_reshards(tmp_path: Path) -> None:
    """Two FSDP ranks save in the background (pieces of at most 1 MiB), train three more steps while it writes,
    then one rank loads it: every weight, Adam moment and step is the saved step's."""
    script = tmp_path / "async_saver.py"
    script.write_text(ASYNC_SAVER)
    run_ranks(script, 2, str(tmp_path), "save")
    run_ranks(script, 1, str(tmp_path), "load")


class FakeActor:
    """The actor group as the driver sees it: a background save finishes when the test says."""

    world_size = 2

    def __init__(self) -> None:
        self.written, self.failure, self.calls = False, "", []

    def call(self, method: str, *args: Any) -> Any:
        self.calls.append(method)
        if method == "save_checkpoint":
            folder, background = Path(args[0]), args[1]
            folder.mkdir()
            (folder / "__0_0.distcp").write_text("shards")
            self.written = not background
            return [{"call_s": 0.01}] * 2
        if method == "checkpoint_written":
            return [self.written, True]
        if method == "wait_checkpoint":
            if self.failure:
                raise WorkerError(self.failure)
            self.written = True
            return [{"write_s": 0.5, "staged_gb": 0.1}, {"write_s": 0.7, "staged_gb": 0.1}]
        if method == "checkpoint_files":  # each rank's view of the folder before the driver publishes it
            root = Path(args[0])
            files = {str(f.relative_to(root)): f.stat().st_size for f in root.rglob("*") if f.is_file()}
            return [{"rank": rank, "node_ip": "127.0.0.1", "files": files} for rank in range(self.world_size)]
        raise AssertionError(method)


class FakeMetrics:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.records.append((step, metrics))


def driver(tmp_path: Path) -> Any:
    from types import SimpleNamespace

    from easytrain.trainer.base import Trainer

    trainer = Trainer.__new__(Trainer)  # the save path only: no workers, no loader process
    trainer.config = load([f"trainer.output_dir={tmp_path}", "trainer.checkpoint_async=true", "trainer.save_freq=1"])
    trainer.checkpoints = CheckpointWriter(tmp_path / "checkpoints")
    trainer.roles = SimpleNamespace(actor=FakeActor())
    trainer.loader = SimpleNamespace(state_dict=lambda: {"position": 0})
    trainer.metrics = FakeMetrics()
    trainer.step, trainer.saved_step, trainer.pending_save, trainer.save_requested = 0, -1, None, False
    return trainer


def test_a_background_save_is_published_only_once_every_rank_wrote_it(tmp_path: Path) -> None:
    trainer = driver(tmp_path)
    root = trainer.checkpoints.root
    trainer.step = 1
    assert trainer.save(background=True) is None
    assert latest(root) is None and (root / ".tmp_global_step_1").is_dir()  # staged, not published
    trainer.step = 2
    trainer.finish_save(wait=False)  # one rank still writing: nothing happens
    assert latest(root) is None and trainer.pending_save is not None
    trainer.roles.actor.written = True
    trainer.finish_save(wait=False)  # every rank done: published at this step boundary
    assert latest(root) == root / "global_step_1" and trainer.pending_save is None
    step, record = trainer.metrics.records[-1]
    assert step == 2 and record["checkpoint/step"] == 1 and record["checkpoint/write_s"] == 0.7
    assert record["checkpoint/blocked_s"] > 0
    trainer.save(background=True)  # step 2
    trainer.step = 3
    folder = trainer.save()  # the end of the run (or a stop): waits for step 2's write, then saves step 3
    assert folder == root / "global_step_3" and (root / LATEST).read_text().strip() == "3"
    assert (root / "global_step_2").is_dir() and trainer.roles.actor.calls.count("wait_checkpoint") == 2


def test_a_failed_background_write_is_reported_and_never_published(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    trainer = driver(tmp_path)
    root = trainer.checkpoints.root
    trainer.step = 1
    trainer.save()  # a published one to fall back on
    trainer.step = 2
    trainer.save(background=True)
    trainer.roles.actor.failure = "actor rank 1 raised OSError: [Errno 5] Input/output error"
    with pytest.raises(WorkerError, match="Input/output error"):
        trainer.finish_save(wait=True)
    assert "writing the checkpoint of step 2 failed; .tmp_global_step_2 is not published" in caplog.text
    assert latest(root) == root / "global_step_1" and not (root / "global_step_2").exists()
    assert trainer.pending_save is None
    trainer.roles.actor.failure = ""  # the next save clears the failed folder
    trainer.step = 3
    trainer.save()
    assert not (root / ".tmp_global_step_2").exists() and latest(root) == root / "global_step_3"

    # a full disk (issue 24): one line naming the checkpoint kept, the half-written folder gone
    trainer.step = 4
    trainer.save(background=True)
    trainer.roles.actor.failure = "actor rank 1 raised OSError: [Errno 28] No space left on device"
    with pytest.raises(RunFailed, match=r"the checkpoint of step 4 was not saved: no space left .* global_step_3 "
                                        r"\(the latest\) is intact"):
        trainer.finish_save(wait=True)
    assert not (root / ".tmp_global_step_4").exists() and latest(root) == root / "global_step_3"
